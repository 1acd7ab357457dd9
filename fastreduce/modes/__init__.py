"""The data-parallel modes, one module each, all on the same layers below them
(:mod:`fastreduce.layout` and :mod:`fastreduce.buffer` for where gradients live,
:mod:`fastreduce.buckets` for backward-order buckets, :mod:`fastreduce.comm` for every
byte that travels, :mod:`fastreduce.backends` for device graphs). No mode picks a
transport or holds device code. The public names are re-exported by :mod:`fastreduce`.

============== ================================================================
 module         communication pattern
============== ================================================================
 fused          one averaging all-reduce of every gradient after backward
 overlap        buckets in backward order, each all-reduced from a gradient hook
 fused_join     (the fused reducer under torch's Join: uneven inputs)
 functional     ``all_reduce_gradients``: the fused reducer kept on the model
 zero           reduce-scatter per bucket, 1/N optimizer step, all-gather
 zero_shard     (what one ZeRO rank holds: its chunks, fp32 masters, the shard's optimizer)
 zero_state     (ZeRO's checkpoints: torch.optim's format, DCP ranges, resharding)
 gossip         per-bucket local step, then neighbour mixing over a topology
 topology       (gossip's mixing matrices: which peers, with which weights)
 local          (the local-update mechanism shared by LocalSGD and DiLoCo)
 localsgd       local steps, parameters averaged every H steps
 diloco         local steps, an outer optimizer step on the averaged delta
 contract       (what every mode declares: how its steps commit, how it closes)
============== ================================================================
"""
