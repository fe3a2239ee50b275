"""On a rank: make a test's `@pytest.mark.megatron` layout the live `parallel_state`, reusing the
one the last test left when it is the same (its process groups are the expensive part).

Imported by the driver too (through `inprocess`): torch and `isolation` load only when called."""

from __future__ import annotations

from ..layouts import ARGUMENTS, Layout


def ensure(layout: Layout, current: Layout | None, held: list[object]) -> Layout:
    """On a rank: make `layout` the live parallel state, reusing `current` when it matches;
    `held` are the groups wider fixture scopes hold, which stay."""
    from megatron.core import parallel_state

    if layout == current and parallel_state.model_parallel_is_initialized():
        return layout
    if parallel_state.model_parallel_is_initialized():
        from . import isolation

        isolation.cleanup_after_job(held)
    parallel_state.initialize_model_parallel(**{ARGUMENTS[k]: v for k, v in layout})
    return layout


def switch(wanted: Layout | None, kept: Layout | None, held: list[object]) -> Layout | None:
    """Make `wanted` the live layout (None: no layout), reusing `kept`; returns the kept one."""
    if wanted is not None:
        return ensure(wanted, kept, held)
    if kept is not None:
        from . import isolation

        isolation.cleanup_after_job(held)  # this test wants no layout: drop the kept one
    return None
