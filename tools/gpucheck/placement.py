"""Where an optimizer's tensors live (plain host memory, pinned, GPU): the offload
check's look at its shards, their grads and its accumulators."""

from __future__ import annotations


def place_kind(tensor) -> str:
    """``cpu`` (plain host memory), ``pinned``, ``gpu`` or ``other``."""
    place = tensor.place
    for kind, method in (("pinned", "is_cuda_pinned_place"), ("gpu", "is_gpu_place"),
                         ("cpu", "is_cpu_place")):
        test = getattr(place, method, None)
        if test is not None and test():
            return kind
    return "other"


def storage_report(optimizer) -> dict:
    """Where the optimizer's tensors live: the shards it holds
    (``optimizer._parameter_list``, param groups flattened), their grads and every
    accumulator (``optimizer._accumulators``: {kind: {param name: tensor}}). ``bad``
    lists those not on a plain CPU place."""
    params = []
    for item in optimizer._parameter_list or []:
        params += list(item["params"]) if isinstance(item, dict) else [item]
    counts = {"params": 0, "grads": 0, "accumulators": 0, "no_grad": 0}
    bad = []

    def look(what, name, tensor):
        counts[what] += 1
        kind = place_kind(tensor)
        if kind != "cpu":
            bad.append(f"{what[:-1]} {name}: {kind}")

    for p in params:
        look("params", p.name, p)
        if p.grad is not None:
            look("grads", p.name, p.grad)
        elif not p.stop_gradient:
            counts["no_grad"] += 1
    for acc, by_param in (getattr(optimizer, "_accumulators", None) or {}).items():
        for name, tensor in by_param.items():
            look("accumulators", f"{acc}[{name}]", tensor)
    return dict(counts, bad=bad)
