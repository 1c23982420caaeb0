"""The CPU allocator's own peak during a step, from the profiler's memory events."""

import copy

from torch.profiler import ProfilerActivity, profile


def cpu_allocator_peak(step, model, inputs) -> int:
    """The CPU allocator's own peak during ``step`` above what existed before it:
    every allocation and free the profiler saw, kernels' internal ones included."""
    model = copy.deepcopy(model)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, *inputs)
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag.name == "Allocation":
            events.append((e.start_time_ns, e.extra_fields.alloc_size))
    live = peak = 0
    for _, nbytes in sorted(events):
        live += nbytes
        peak = max(peak, live)
    return peak
