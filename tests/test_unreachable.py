"""A store's server that is not there: a member whose coordinator does not listen, a rank
whose ``MASTER_ADDR:MASTER_PORT`` does not. Each raises fastreduce's one-line error within
the connect timeout (5 s by default, ``FASTREDUCE_CONNECT_TIMEOUT_S``), and nothing of
c10d's (its warnings, its C++ backtraces) reaches stderr. A server started a moment after
its clients is still reached.

"Nothing listens" is a port bound by this test and never listened on: a connection to it
is refused, and no other process can take it meanwhile. The scripts run in fresh
interpreters (stderr is the process's), each bounded by a timeout; the seconds they
took to raise are printed (``pytest -s``), and only a bound that catches a hang is
asserted.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
from launching import coordinator_process

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)
HANG_S = 30  # far above the default 5 s: only a hang fails


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port of 127.0.0.1 where a connection is refused (bound, not listening) while held."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]
    finally:
        sock.close()


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("FASTREDUCE_CONNECT_TIMEOUT_S", "TORCHELASTIC_USE_AGENT_STORE", "MASTER_ADDR",
                        "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "FASTREDUCE_DEVICE": "cpu", **extra}


def _start(script: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=_env(**env),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the script did not finish in {timeout:.0f} s; stdout:\n{out}\nstderr:\n{err[-4000:]}")


# What a user's script does, the error caught and printed: its one line on stderr, the
# seconds the call took on stdout.
RAISES = """
    import sys, time
    import fastreduce
    start = time.monotonic()
    try:
        {call}
    except {error} as err:
        print(f"{{time.monotonic() - start:.2f}}")
        print(f"{{type(err).__name__}}: {{err}}", file=sys.stderr)
        sys.exit(3)
    sys.exit("it did not raise")
"""


def _raises_quietly(call: str, error: str, **env: str) -> tuple[float, str]:
    """Run ``call`` in a fresh interpreter; it must raise ``error`` and write at most 5
    lines to stderr. The seconds it took, and the error's line."""
    proc = _start(RAISES.format(call=call, error=error), **env)
    out, err = _finish(proc)
    assert proc.returncode == 3, (proc.returncode, out, err[-4000:])
    lines = err.strip().splitlines()
    assert len(lines) <= 5, f"{len(lines)} lines on stderr:\n{err[-4000:]}"
    assert "c10d" not in err and "frame #" not in err, err
    seconds = float(out.split()[-1])
    print(f"\n{call}: raised in {seconds:.2f} s, {len(lines)} line(s) on stderr")
    assert seconds < HANG_S, seconds
    return seconds, lines[-1]


def test_a_member_whose_coordinator_does_not_listen_raises_naming_it_and_what_to_start() -> None:
    with refusing_port() as port:
        _, line = _raises_quietly(f"fastreduce.Membership('127.0.0.1:{port}', world_size=2)",
                                  "fastreduce.MembershipError")
    assert line.startswith(f"MembershipError: fastreduce: cannot reach the coordinator at 127.0.0.1:{port} ("), line
    assert f"start it first: `fastreduce coordinator --port {port}`" in line, line
    assert "FASTREDUCE_CONNECT_TIMEOUT_S" in line, line


def test_a_rank_whose_master_addr_does_not_listen_raises_naming_it_and_rank_0() -> None:
    with refusing_port() as port:
        _, line = _raises_quietly("fastreduce.init_distributed()", "RuntimeError", MASTER_ADDR="127.0.0.1",
                                  MASTER_PORT=str(port), RANK="1", WORLD_SIZE="2", LOCAL_RANK="0")
    assert line.startswith("DistNetworkError: fastreduce: rank 1 of 2 cannot reach the job's store at "
                           f"MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port} (connection refused"), line
    assert "start the process with RANK=0" in line and "torchrun" in line, line


@contextmanager
def silent_listener() -> Iterator[int]:
    """A port of 127.0.0.1 where a connection is accepted and never answered (as an etcd
    endpoint answers c10d's handshake: not at all), while held."""
    sock, held = socket.socket(socket.AF_INET, socket.SOCK_STREAM), []
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def accept() -> None:
        while True:
            try:
                held.append(sock.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()
        for conn in held:
            conn.close()


def test_a_listener_that_is_not_a_coordinator_is_named_within_the_timeout() -> None:
    """An address where something listens but no c10d store answers (an etcd endpoint given
    without etcd://): c10d's handshake blocked there for good (``fastreduce status HOST:PORT``
    and ``Membership(coordinator=...)`` hung); now MembershipError within ``timeout_s``, saying
    what it likely is, and the process exits."""
    with silent_listener() as port:
        seconds, line = _raises_quietly(f"fastreduce.membership.connect('127.0.0.1:{port}', timeout_s=2)",
                                        "fastreduce.MembershipError")
    assert seconds < 12, seconds  # (the first use imports torch: seconds on a loaded machine)
    assert line.startswith(f"MembershipError: fastreduce: something listens at 127.0.0.1:{port} but is not a "
                           "fastreduce coordinator (no answer to a coordinator's handshake within 2 s)"), line
    assert f"give it as etcd://127.0.0.1:{port}[/job]" in line, line


def test_a_member_whose_coordinator_goes_silent_raises_and_closes_within_seconds() -> None:
    """A warm spare waits (its pulse beating) when its coordinator's host hangs (SIGSTOP: a
    partition is the same to a client, and the far side of one closes the same way): join()
    raises MembershipError within seconds, and the ``finally: m.close()`` after it returns
    within seconds too; it never did (Pulse.stop joined a thread stuck in a beat on the silent
    link, which c10d's own timeout does not end). The coordinator's address counts as another
    host's, as it usually is (requests bounded by 5 s)."""
    import signal

    from fastreduce.coordinator import connect, ticket_key

    with coordinator_process(cwd=ROOT, env=_env()) as (coordinator, port):
        member = _start(f"""
            import time
            import torch
            import fastreduce
            import fastreduce.coordinator as coordinator
            coordinator.process_identity.served_here = lambda store: False  # (another host's address)
            model = torch.nn.Linear(4, 1)
            m = fastreduce.Membership("127.0.0.1:{port}", world_size=1, member="spare", spare=True, wait_s=1)
            try:
                m.join({{"model": model}}, lambda: fastreduce.FusedReducer(model))
            except fastreduce.MembershipError as err:
                print("raised:", err, flush=True)
            finally:
                start = time.monotonic()
                m.close()
                print(f"closed in {{time.monotonic() - start:.2f}} s", flush=True)
        """)
        store = connect(f"127.0.0.1:{port}")
        store.wait([ticket_key(1)])  # the spare registered (its pulse up before), waiting
        os.kill(coordinator.pid, signal.SIGSTOP)
        try:
            out, err = member.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            member.kill()
            out, err = member.communicate()
            pytest.fail(f"the member did not end within 60 s; stdout:\n{out}\nstderr:\n{err[-4000:]}")
    print(out)
    assert "raised: fastreduce: the coordinator (127.0.0.1:" in out and "stopped answering" in out, (out, err[-4000:])
    seconds = float(out.split("closed in ")[1].split()[0])
    assert seconds < 10, out
    assert member.returncode == 0, (member.returncode, err[-4000:])


def test_the_connect_timeout_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``FASTREDUCE_CONNECT_TIMEOUT_S`` and ``connect_timeout_s=`` set how long a member
    tries; a bad value is named."""
    with refusing_port() as port:
        seconds, line = _raises_quietly(f"fastreduce.membership.connect('127.0.0.1:{port}')",
                                        "fastreduce.MembershipError", FASTREDUCE_CONNECT_TIMEOUT_S="0.5")
        assert "tried for 0.5 s" in line, line
        seconds, line = _raises_quietly("fastreduce.init_distributed(connect_timeout_s=0.5)", "RuntimeError",
                                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1", WORLD_SIZE="2")
        assert "tried for 0.5 s" in line, line
    from fastreduce import reach

    monkeypatch.setenv("FASTREDUCE_CONNECT_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match=r"\$FASTREDUCE_CONNECT_TIMEOUT_S must be a number of seconds, got 'soon'"):
        reach.connect_timeout()
    with pytest.raises(ValueError, match="connect_timeout_s must be > 0 seconds, got 0"):
        reach.connect_timeout(0)


def _wait_for_line(proc: subprocess.Popen, word: str) -> None:
    line = proc.stdout.readline()
    if word not in line:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"expected {word!r}, got {line!r}{out}; stderr:\n{err[-4000:]}")


def test_a_coordinator_started_a_second_after_its_member_is_reached() -> None:
    """Members launched together with their coordinator, a little before it (a launch
    script, a scheduler): the member keeps trying until it listens."""
    from fastreduce.membership import serve

    with refusing_port() as port:
        member = _start(f"""
            import fastreduce
            print("connecting", flush=True)
            m = fastreduce.Membership("127.0.0.1:{port}", world_size=2)
            m.link.store.set("test/hello", "from the member")
            print("connected", flush=True)
        """)
        _wait_for_line(member, "connecting")
    time.sleep(1.0)
    server = serve(port, "127.0.0.1")
    out, err = _finish(member)
    assert member.returncode == 0 and "connected" in out, (member.returncode, out, err[-4000:])
    assert server.get("test/hello") == b"from the member"
    assert not err.strip(), err


RANK = """
    import sys
    import torch, torch.distributed as dist
    import fastreduce
    {wait}
    info = fastreduce.init_distributed()
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    print(f"rank {{info.rank}} of {{info.world_size}}: {{t.item():g}}", flush=True)
    dist.destroy_process_group()
"""


def test_rank_0_started_a_second_after_rank_1_is_reached() -> None:
    """Rank 1 tries its MASTER_ADDR before rank 0 hosts the store there; rank 0 starts
    a second later and the two form a real Gloo group."""
    with refusing_port() as port:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
        rank0 = _start(RANK.format(wait='print("ready", flush=True); sys.stdin.readline()'), RANK="0", **env)
        rank1 = _start(RANK.format(wait='print("connecting", flush=True)'), RANK="1", **env)
        _wait_for_line(rank0, "ready")
        _wait_for_line(rank1, "connecting")
    time.sleep(1.0)
    rank0.stdin.write("go\n")
    rank0.stdin.flush()
    for rank, proc in enumerate((rank0, rank1)):
        out, err = _finish(proc)
        assert proc.returncode == 0, (rank, out, err[-4000:])
        assert f"rank {rank} of 2: 3" in out, (rank, out, err[-4000:])
