"""What ``fully_shard`` builds and runs every step.

Lowest first: :mod:`.registry` (every unit, and which owns which parameter; imports
nothing of the package), :mod:`.trace`, :mod:`.policies`, :mod:`.param` (one
parameter's blocks), :mod:`.buffer` (one fused buffer and its collectives), :mod:`.unit`
(one ``fully_shard`` unit), :mod:`.hooks`, :mod:`.experts`, :mod:`.optimizers` (what the
engine reads of an optimizer, ``finish_grad_sync``), :mod:`.flex` (``ShardedWeight``\\ s
for ``flex_checkpoint``) and the front end :mod:`.api` (``fully_shard``, ``FSDPModule``).
"""
