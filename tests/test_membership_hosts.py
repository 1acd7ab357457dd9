"""ZeRO's shard copies on other hosts: ``ZeroOptimizer(redundant=k)`` under fastreduce.Membership,
its members on network-namespace hosts of 2 members each (the coordinator on the first), both
members of the last host killed in the same step (a host lost whole).

The copies of a shard go to ranks of other hosts first (:class:`fastreduce.modes.zero_mirror.Placement`,
from each rank's host name and network namespace), so the host's two shards go on from copies
held elsewhere: one copy is enough for a whole host, where copies on the next ranks (the same
host's, as launchers number ranks) would have been lost with it. The survivors train on to the
last step, bit-identical and equal to torch.optim.AdamW on the mean gradient of the members'
batches (the world of each committed step), and no two members ever commit different parameters
at one step (a digest of the parameters at every committed step).

Needs root and iproute2 (``ip netns``); skipped elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastreduce.bench.hosts import namespace_hosts
from test_membership import _same, adamw_on_the_mean
from test_partition import _hosts_possible  # noqa: F401  (autouse: skipped where namespace hosts cannot be made)

ROOT = Path(__file__).resolve().parent.parent
STEPS = 40
KILL_STEP = 10
PORT = 29420
pytestmark = pytest.mark.timeout(420)


@pytest.mark.parametrize("hosts, copies", [(4, 1), (8, 2)], ids=["4hosts-k1", "8hosts-k2"])
@pytest.mark.cell("loop", "train", membership=True, modes=("zero",))
def test_a_whole_host_lost_at_once_loses_no_zero_shard(tmp_path: Path, hosts: int, copies: int) -> None:
    world = 2 * hosts
    lost = (world - 2, world - 1)  # the last host's two members
    with namespace_hosts(hosts) as hs:
        a = hs[0]
        procs = [subprocess.Popen(a.command([sys.executable, "-m", "fastreduce", "coordinator", "--host", a.addr,
                                             "--port", str(PORT)]), stdout=subprocess.DEVNULL)]
        try:
            for k in range(world):
                kill = ("mid-step", KILL_STEP) if k in lost else None
                code = ("import sys; sys.path.insert(0, 'examples'); from keep_training import member; "
                        f"member({k}, '{a.addr}:{PORT}', sys.argv[1], 'process_group', {kill!r}, None, "
                        f"steps={STEPS}, world={world}, mode='zero', redundant={copies}, verbose=True)")
                log = open(tmp_path / f"log-{k}", "w")  # noqa: SIM115 - closed with the process
                procs.append(subprocess.Popen(hs[k // 2].command([sys.executable, "-c", code, str(tmp_path)],
                                                                 {"OMP_NUM_THREADS": "1"}),
                                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            for p in procs[1:]:
                p.wait(timeout=360)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in sorted(tmp_path.glob("log-*")))
    assert not [k for k in lost if (tmp_path / f"member{k}.pt").exists()], logs  # they died
    final = [torch.load(tmp_path / f"member{k}.pt", weights_only=False) for k in range(world) if k not in lost]
    for f in final:
        assert "error" not in f and "refused" not in f, (f.get("error") or f.get("refused"), logs)
        assert f["steps"][-1][:2] == (STEPS, True) and f["world"] == world - 2, (f["steps"][-3:], f["world"], logs)
        assert f["counters"]["discarded_steps"] == 1, f["counters"]
        assert f["hosts"] == hosts - 1, f["hosts"]  # the copies placed knowing the survivors' hosts
    for step in range(1, STEPS + 1):
        assert len({f["digests"][step] for f in final}) == 1, step
    _same(final)
    want = adamw_on_the_mean([world] * KILL_STEP + [world - 2] * (STEPS - KILL_STEP))
    assert torch.allclose(final[0]["params"], want, rtol=0, atol=1e-6), float((final[0]["params"] - want).abs().max())
