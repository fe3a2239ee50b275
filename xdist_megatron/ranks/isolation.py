"""Process-global state of a rank: cleanup after every job, snapshot/restore at module boundaries.

A gang's ranks outlive the tests they run, so whatever a test leaves in process-global state
(torch flags, RNG streams, environment variables, process groups, Megatron and Transformer Engine
singletons) would leak into the next test. `cleanup_after_job` drops what no later test may inherit;
`restore` puts back what the rank looked like right after it joined its gang.

Optional packages (numpy, megatron.core, transformer_engine) are only acted on when a test already
imported them: importing them here would cost seconds per rank. CUDA is only touched when this
process already initialised it: ranks are forked, and initialising CUDA costs time and GPU memory.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import os
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StartupState:
    """What a rank looked like right after it joined its gang; `restore` returns it there."""

    settings: dict[str, Any]
    environ: dict[str, str]
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] | None  # None: CUDA was not initialised yet
    cuda_seed: int  # the seed CUDA's generators take if CUDA starts after the snapshot
    python_rng: tuple[Any, ...]
    numpy_rng: Any | None  # None: numpy.random was not imported yet


def snapshot() -> StartupState:
    """Record process-global state; called once on each rank right after init_process_group."""
    numpy_random = sys.modules.get("numpy.random")
    return StartupState(
        settings=_read_settings(),
        environ=dict(os.environ),
        torch_rng=torch.get_rng_state(),
        cuda_rng=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
        # What torch.manual_seed queued for CUDA before it starts (unseeded, CPU and CUDA each
        # draw an arbitrary seed, so this one serves as well).
        cuda_seed=torch.initial_seed(),
        python_rng=random.getstate(),
        numpy_rng=numpy_random.get_state() if numpy_random is not None else None,
    )


def rebase(base: StartupState, before: StartupState, after: StartupState) -> StartupState:
    """`base` with what changed between `before` and `after` (a session fixture's setup), so
    that module boundaries keep what session fixtures set, and only that."""
    settings = dict(base.settings)
    settings.update((k, v) for k, v in after.settings.items() if before.settings.get(k) != v)
    removed = before.environ.keys() - after.environ.keys()
    environ = {k: v for k, v in base.environ.items() if k not in removed}
    environ.update((k, v) for k, v in after.environ.items() if before.environ.get(k) != v)
    changes: dict[str, Any] = {"settings": settings, "environ": environ}
    if not torch.equal(before.torch_rng, after.torch_rng):
        changes.update(torch_rng=after.torch_rng, cuda_rng=after.cuda_rng)
        changes["cuda_seed"] = after.cuda_seed
    if before.python_rng != after.python_rng:
        changes["python_rng"] = after.python_rng
    if _numpy_state_changed(before.numpy_rng, after.numpy_rng):
        changes["numpy_rng"] = after.numpy_rng
    return dataclasses.replace(base, **changes)


def _numpy_state_changed(before: Any, after: Any) -> bool:
    if before is None or after is None:
        return after is not None
    return repr(before[2:]) != repr(after[2:]) or bool((before[1] != after[1]).any())


def restore(state: StartupState) -> None:
    """Called at a module boundary on every rank, after `cleanup_after_job` (which let go of the
    libraries' state and the groups): back to the recorded settings, RNG states and environment."""
    gc.collect()  # what the module's tests left in reference cycles
    _write_settings(state.settings)
    _restore_rng(state)
    restore_environ(state.environ)


def cleanup_after_job(
    keep_groups: Iterable[object] = (),
    keep_megatron: bool = False,
    keep_libraries: bool = False,
    destroy_groups: bool = True,
) -> None:
    """Called on every rank after every job (all ranks call it collectively). An error here (e.g. a
    sticky CUDA error surfacing from torch.cuda.synchronize) must propagate so the test that caused
    it fails.

    What a wider scope still holds stays: the process groups in `keep_groups`; with
    `keep_megatron`, megatron.core.parallel_state and its groups (a kept layout; every other
    singleton is still reset); with `keep_libraries`, all of Megatron's and Transformer Engine's
    state (a class fixture that set Megatron up for its tests). Without `destroy_groups` the
    process groups are left for the module boundary (see `GROUP_LIMIT`).
    """
    __tracebackhide__ = True
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()  # an asynchronous CUDA error surfaces here, in its own test
    _forget_the_last_failure()
    # What the test left in reference cycles ends here, not at a gc run inside a later test: a
    # finalizer that tears down global state (Megatron-LM's MoEModelTestContainer.__del__ calls
    # destroy_model_parallel) would otherwise break whichever test it lands in.
    gc.collect()
    if not keep_libraries:
        _teardown_transformer_engine()
        _teardown_megatron(keep_parallel_state=keep_megatron)
    kept = _kept(keep_groups, keep_megatron or keep_libraries)
    if destroy_groups and _destroy_process_groups(keep=kept):
        gc.collect()  # finalizers of destroyed groups must run before the next job starts
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _forget_the_last_failure() -> None:
    """pytest keeps a failed test's exception in sys.last_* (for post-mortem debugging) until the
    next failure: its frames would keep the test's objects, tensors included, alive."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)


# Destroying a process group costs ~10 ms (its threads are joined; NCCL frees its communicator),
# and megatron's initialize_model_parallel makes ~20: destroyed after every test that would be
# ~0.2-0.5 s a test. A test's groups are left registered (as torchrun leaves them all session)
# and destroyed at the module boundary, or after the test that brings their number over this.
GROUP_LIMIT = 128


def groups_made() -> int:
    """How many process groups this process has created: the same count on every rank (new_group
    is called by every rank of the default group, members or not), so a decision on it is too."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    return dist.distributed_c10d._world.group_count


def release(groups: list[object], megatron: bool) -> None:
    """A fixture scope ended: drop the groups (the list is emptied: the groups' last references
    go to the reaper) and library state its fixture created."""
    if megatron:
        _teardown_transformer_engine()
        _teardown_megatron(keep_parallel_state=False)
    alive = {id(group) for group in process_groups()}
    doomed = [group for group in groups if id(group) in alive]
    groups.clear()
    if dist.is_available() and dist.is_initialized():
        _destroy(doomed)  # collective even where this rank is in none of the groups


def process_groups() -> list[object]:
    """Every registered process group but the default one."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    world = dist.distributed_c10d._world
    return [pg for pg in world.pg_map if pg is not world.default_pg]


def megatron_fingerprint() -> tuple[object, ...]:
    """Identities of Megatron's singletons: a change means code set Megatron state up."""
    if "megatron.core" not in sys.modules:
        return ()
    parallel_state = sys.modules.get(_PARALLEL_STATE)
    values = [getattr(parallel_state, "_TENSOR_MODEL_PARALLEL_GROUP", None)]
    for module_name, name in _MEGATRON_SINGLETONS:
        values.append(getattr(sys.modules.get(module_name), name, None))
    return tuple(id(v) for v in values)


def _kept(keep_groups: Iterable[object], keep_megatron: bool) -> list[object]:
    return [*keep_groups, *(_megatron_process_groups() if keep_megatron else ())]


# --- torch settings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Setting:
    """How to read one process-global torch setting and how to write it back."""

    get: Callable[[], Any]
    set: Callable[[Any], None]


def _attribute(owner: object, name: str) -> _Setting:
    return _Setting(lambda: getattr(owner, name), lambda value: setattr(owner, name, value))


def _functions(owner: object, getter: str, setter: str) -> _Setting:
    return _Setting(lambda: getattr(owner, getter)(), lambda value: getattr(owner, setter)(value))


def _reduced_precision_reduction(dtype: str) -> _Setting:
    """cuBLAS reduced-precision reduction, with its split-K switch where torch has one."""
    name = f"allow_{dtype}_reduced_precision_reduction"
    matmul = torch.backends.cuda.matmul

    def get() -> Any:
        allowed = getattr(matmul, name)
        try:
            return (allowed, getattr(matmul, f"{name}_split_k"))
        except AttributeError:
            return allowed

    return _Setting(get, lambda value: setattr(matmul, name, value))


# Parents first: setting ("generic", "all") or (backend, "all") overwrites the entries below it.
_FP32_PRECISION_KEYS = (("generic", "all"),) + tuple(
    (backend, op) for backend in ("cuda", "mkldnn") for op in ("all", "matmul", "conv", "rnn")
)


def _get_fp32_precision() -> dict[tuple[str, str], str]:
    get = torch._C._get_fp32_precision_getter  # AttributeError before torch 2.9
    values = {}
    for key in _FP32_PRECISION_KEYS:
        try:
            values[key] = get(*key)
        except RuntimeError:  # a (backend, op) pair this torch release does not know
            continue
    return values


def _set_fp32_precision(values: dict[tuple[str, str], str]) -> None:
    for (backend, op), precision in values.items():
        torch._C._set_fp32_precision_setter(backend, op, precision)


def _get_deterministic() -> tuple[bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )


def _set_deterministic(value: tuple[bool, bool]) -> None:
    if "torch._inductor.config" in sys.modules:
        torch.use_deterministic_algorithms(value[0], warn_only=value[1])
    else:
        # The public setter imports torch._inductor (seconds, hundreds of modules) only to copy
        # the flag into its config; with inductor not loaded, the switch itself is all there is.
        torch._C._set_deterministic_algorithms(value[0], warn_only=value[1])


def _get_anomaly_mode() -> tuple[bool, bool]:
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


def _set_anomaly_mode(value: tuple[bool, bool]) -> None:
    torch.autograd.set_detect_anomaly(value[0], check_nan=value[1])


def _get_default_device() -> torch.device:
    get = torch.get_default_device  # AttributeError where torch has none: not restored
    try:
        return get()
    except AttributeError:  # torch 2.4, once set_default_device(None) left no device mode
        return torch.device("cpu")


def _set_default_device(device: torch.device) -> None:
    # A default device of "cpu" is torch's state without a device mode; installing one would tax
    # every factory call.
    torch.set_default_device(None if device.type == "cpu" else device)


_cudnn = torch.backends.cudnn
_cuda = torch.backends.cuda

# Restored in this order. The legacy TF32 switches come before the fp32_precision API: writing a
# legacy switch also rewrites fp32_precision entries, and torch >= 2.9 refuses legacy reads once the
# two disagree, so the exact fp32_precision entries must be written last.
_SETTINGS: dict[str, _Setting] = {
    "cudnn.enabled": _attribute(_cudnn, "enabled"),
    "cudnn.benchmark": _attribute(_cudnn, "benchmark"),
    "cudnn.deterministic": _attribute(_cudnn, "deterministic"),
    "cudnn.allow_tf32": _attribute(_cudnn, "allow_tf32"),
    "cuda.matmul.allow_tf32": _attribute(_cuda.matmul, "allow_tf32"),
    "float32_matmul_precision": _functions(
        torch, "get_float32_matmul_precision", "set_float32_matmul_precision"
    ),
    "cuda.matmul.fp16_reduction": _reduced_precision_reduction("fp16"),
    "cuda.matmul.bf16_reduction": _reduced_precision_reduction("bf16"),
    "cuda.matmul.allow_fp16_accumulation": _attribute(_cuda.matmul, "allow_fp16_accumulation"),
    "fp32_precision": _Setting(_get_fp32_precision, _set_fp32_precision),
    "sdp.flash": _functions(_cuda, "flash_sdp_enabled", "enable_flash_sdp"),
    "sdp.mem_efficient": _functions(_cuda, "mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
    "sdp.math": _functions(_cuda, "math_sdp_enabled", "enable_math_sdp"),
    "sdp.cudnn": _functions(_cuda, "cudnn_sdp_enabled", "enable_cudnn_sdp"),
    "deterministic_algorithms": _Setting(_get_deterministic, _set_deterministic),
    "anomaly_mode": _Setting(_get_anomaly_mode, _set_anomaly_mode),
    "default_dtype": _functions(torch, "get_default_dtype", "set_default_dtype"),
    "default_device": _Setting(_get_default_device, _set_default_device),
    "grad_enabled": _functions(torch, "is_grad_enabled", "set_grad_enabled"),
    "num_threads": _functions(torch, "get_num_threads", "set_num_threads"),
}


def _read_settings() -> dict[str, Any]:
    values = {}
    for name, setting in _SETTINGS.items():
        try:
            values[name] = setting.get()
        except (AttributeError, RuntimeError):
            # Not in this torch release, or a legacy TF32 read that torch >= 2.9 refuses once the
            # fp32_precision API was used: restore what can be read.
            continue
    return values


def _write_settings(values: dict[str, Any]) -> None:
    """Write back only what changed: a setter may cost more than a read."""
    for name, value in values.items():
        setting = _SETTINGS[name]
        try:
            changed = setting.get() != value
        except RuntimeError:  # a legacy TF32 read refused: the switches disagree, so write
            changed = True
        if changed:
            setting.set(value)


# --- RNG and environment -------------------------------------------------------------------------


def _restore_rng(state: StartupState) -> None:
    torch.set_rng_state(state.torch_rng)
    random.setstate(state.python_rng)
    if torch.cuda.is_initialized():
        if state.cuda_rng is None:
            # CUDA started after the snapshot: back to freshly started generators.
            torch.cuda.manual_seed_all(state.cuda_seed)
        else:
            torch.cuda.set_rng_state_all(state.cuda_rng)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        if state.numpy_rng is None:
            numpy_random.seed()  # imported after the snapshot: reseed from entropy, as on import
        else:
            numpy_random.set_state(state.numpy_rng)


def restore_environ(saved: dict[str, str]) -> None:
    """Exact restore through os.environ, so the C-level environment (putenv) follows too."""
    for key in [key for key in os.environ if key not in saved]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


# --- process groups ------------------------------------------------------------------------------


def _destroy_process_groups(keep: Iterable[object]) -> bool:
    """Destroy every process group but the default one and those in `keep`; whether any went.

    Collective, so every rank of the default group calls it at the same point: a barrier first,
    so that no rank destroys a group another rank still uses, then creation order, which is the
    same on every member of a group.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    kept = {id(group) for group in keep}
    doomed = [group for group in process_groups() if id(group) not in kept]
    _destroy(doomed)  # also with nothing to destroy here: a peer may have groups this rank lacks
    return bool(doomed)


def _destroy(doomed: list[object]) -> None:
    """Unregister the groups (collective: a barrier first), then let them end off the critical
    path. An NCCL communicator that was used takes ~0.35 s to shut down (measured on H200) and
    destroy_process_group shuts groups down one at a time; shut down on threads first (torch
    releases the GIL there) they take a sixth of that, and the second shutdown is a no-op. The
    destructors left (a gloo group joins its threads, ~18 ms) go to the reaper, so the next test
    runs while they end."""
    dist.barrier()
    _shutdown_together([group for group in doomed if "nccl" in dist.get_backend(group)])
    for index in range(len(doomed)):  # no loop variable: it would keep the last group alive
        dist.destroy_process_group(doomed[index])
    _REAPER.take(doomed)


def _shutdown_together(groups: list[object]) -> None:
    """Shut the groups down on a few threads at once (ProcessGroup.shutdown is torch >= 2.6;
    before it, destroy_process_group shuts each down alone). `groups` is emptied."""
    shutdowns = [getattr(group, "shutdown", None) for group in groups]
    groups.clear()
    with concurrent.futures.ThreadPoolExecutor(SHUTDOWN_THREADS) as pool:
        for _ in pool.map(lambda shutdown: shutdown(), filter(None, shutdowns)):
            pass  # an exception (a shutdown that failed) is raised here, in the test that ended
    shutdowns.clear()


SHUTDOWN_THREADS = 16


class _Reaper:
    """Runs the destructors of destroyed process groups on threads of their own, a few groups a
    thread (each destructor mostly waits for its own threads to end), one batch at a time: the
    next batch waits for the last."""

    THREADS = 8

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []

    def take(self, doomed: list[object]) -> None:
        """Hold the last references of `doomed` (emptied) and drop them on the reaper threads."""
        self.wait()
        shares = [doomed[i :: self.THREADS] for i in range(self.THREADS)]
        doomed.clear()
        for share in shares:
            if share:
                thread = threading.Thread(
                    target=share.clear, name="xdist-megatron-reaper", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def wait(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads.clear()


_REAPER = _Reaper()


def _process_groups_in(value: object) -> Iterator[object]:
    if isinstance(value, dist.ProcessGroup):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _process_groups_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _process_groups_in(item)


def _megatron_process_groups() -> list[object]:
    """The process groups megatron.core.parallel_state holds (none if Megatron is not loaded)."""
    parallel_state = sys.modules.get(_PARALLEL_STATE)
    if parallel_state is None:
        return []
    return [group for value in vars(parallel_state).values() for group in _process_groups_in(value)]


# --- Megatron ------------------------------------------------------------------------------------

_PARALLEL_STATE = "megatron.core.parallel_state"
_PARALLEL_STATE_RESETS = (
    "destroy_model_parallel",
    "destroy_global_memory_buffer",
    "destroy_global_symmetric_memory_buffer",
)
# Globals destroy_model_parallel() leaves set: the data-parallel overrides win over the real values
# in the next layout, the others keep stale ranks or groups.
_PARALLEL_STATE_LEFTOVERS = (
    "_MPU_DATA_PARALLEL_WORLD_SIZE",
    "_MPU_DATA_PARALLEL_RANK",
    "_EMBEDDING_GLOBAL_RANKS",
    "_PIPELINE_GLOBAL_RANKS",
    "_DATA_PARALLEL_GLOBAL_RANKS",
    "_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP",
    "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS",
    "_EXPERT_MODEL_PARALLEL_RANKS",
    "_MODEL_PARALLEL_GLOBAL_RANKS",
    "_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
    "_HYBRID_DP_CP_GROUPS",
)
_CUDA_GRAPHS = "megatron.core.transformer.cuda_graphs"
_MEGATRON_RESETS = (
    ("megatron.core.num_microbatches_calculator", "destroy_num_microbatches_calculator"),
    ("megatron.core.rerun_state_machine", "destroy_rerun_state_machine"),
    ("megatron.core.transformer.moe.moe_logging", "destroy_moe_metrics_tracker"),
    ("megatron.core.transformer.moe.moe_logging", "destroy_moe_overload_factor_tracker"),
    (_CUDA_GRAPHS, "delete_cuda_graphs"),
)
# Singletons whose identity tells that a fixture set Megatron up (see megatron_fingerprint).
_MEGATRON_SINGLETONS = (
    ("megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER"),
    ("megatron.core.num_microbatches_calculator", "_GLOBAL_NUM_MICROBATCHES_CALCULATOR"),
    (_PARALLEL_STATE, "_GLOBAL_MEMORY_BUFFER"),
)
_MEGATRON_RNG_TRACKERS = (
    "megatron.core.tensor_parallel.random",
    "megatron.core.distributed.fsdp.src.megatron_fsdp.utils",
)
_MOE_UTILS = "megatron.core.transformer.moe.moe_utils"


def _loaded_function(module_name: str, name: str) -> Callable[..., Any] | None:
    """`name` from `module_name` if a test already imported that module; never imports it."""
    return getattr(sys.modules.get(module_name), name, None)


def _teardown_megatron(keep_parallel_state: bool) -> None:
    """Reset Megatron's singletons; only modules already imported can hold any state."""
    if "megatron.core" not in sys.modules:
        return
    if not keep_parallel_state:
        _reset_parallel_state()
    for module_name, name in _MEGATRON_RESETS:
        reset = _loaded_function(module_name, name)
        if reset is not None and _needs_reset(module_name):
            reset()
    _clear_moe_aux_losses()
    for module_name in _MEGATRON_RNG_TRACKERS:
        _reset_rng_tracker(sys.modules.get(module_name))


def _needs_reset(module_name: str) -> bool:
    """delete_cuda_graphs runs a full gc.collect (~0.1 s): only when there are graphs."""
    if module_name != _CUDA_GRAPHS:
        return True
    module = sys.modules[module_name]
    record = getattr(module, "_CudagraphGlobalRecord", None)
    manager = getattr(module, "CudaGraphManager", None)
    return (
        record is None
        or bool(getattr(record, "cudagraph_created", True))
        or bool(getattr(record, "cudagraph_record", True))
        or bool(getattr(record, "cudagraph_inference_record", True))
        or getattr(manager, "global_mempool", None) is not None
    )


def _reset_parallel_state() -> None:
    parallel_state = sys.modules.get(_PARALLEL_STATE)
    if parallel_state is None:
        return
    # destroy_model_parallel() destroys its gloo groups one at a time, joining their threads
    # (4.5 s over Megatron-LM's 280 unit tests on 2 x H200). Let go of here, they go with the
    # test's other groups, on threads and later (see GROUP_LIMIT); it clears the rest.
    for name, value in list(vars(parallel_state).items()):
        if isinstance(value, dist.ProcessGroup):
            setattr(parallel_state, name, None)
    for name in _PARALLEL_STATE_RESETS:
        reset = _loaded_function(_PARALLEL_STATE, name)
        if reset is not None:
            reset()
    for name in _PARALLEL_STATE_LEFTOVERS:
        if hasattr(parallel_state, name):
            pristine = {} if isinstance(getattr(parallel_state, name), dict) else None
            setattr(parallel_state, name, pristine)


def _clear_moe_aux_losses() -> None:
    """megatron-core 0.16 keeps MoE aux losses (tensors and their groups) in a module-level dict."""
    tracker = getattr(sys.modules.get(_MOE_UTILS), "_MOE_LAYER_WISE_LOGGING_TRACKER", None)
    if isinstance(tracker, dict):
        tracker.clear()


def _reset_rng_tracker(module: ModuleType | None) -> None:
    initialize = getattr(module, "initialize_rng_tracker", None)
    if initialize is None:
        return
    initialize(force_reset=True)
    # force_reset installs a default tracker and marks it initialised, which would pin its class
    # for the next test; start-up had none, so let the next caller choose again.
    if hasattr(module, "_CUDA_RNG_STATE_TRACKER_INITIALIZED"):
        module._CUDA_RNG_STATE_TRACKER_INITIALIZED = False


# --- Transformer Engine --------------------------------------------------------------------------

_TE_FP8_STATE_MODULES = (
    "transformer_engine.pytorch.quantization",
    "transformer_engine.pytorch.fp8",
)
_TE_ATTENTION_MODULES = (
    "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention",
    "transformer_engine.pytorch.attention",
)
_TE_UB_MODULE = "transformer_engine.pytorch.module.base"
_TE_DISTRIBUTED_MODULE = "transformer_engine.pytorch.distributed"
_TE_GRAPH_MODULE = "transformer_engine.pytorch.graph"
# Before the process groups go: the symmetric-memory pool and EP buffers use their communicators.
_TE_RESETS = (
    ("transformer_engine.pytorch.ep", "ep_finalize"),
    (_TE_DISTRIBUTED_MODULE, "release_symm_mem_pool"),
)
# Left alone (TE 2.20.2): the class `__call__` a make_graphed_callables that raised leaves patched
# (undoing it means reading the patch's closure); the ALiBi cache and TE's debug state (neither
# used by Megatron's tests); fusions registered on the op fuser; what TE reads from the
# environment at import (only a re-import would read it again); caches of tensors (memory only).


def _teardown_transformer_engine() -> None:
    """Reset TE's global state. Each step is guarded: a half-broken TE (it raises RuntimeError or
    FileNotFoundError, not ImportError) must not stop the rest of the cleanup."""
    if "transformer_engine" not in sys.modules:
        return
    for action in _transformer_engine_resets():
        try:
            action()
        except Exception as error:
            warnings.warn(f"Transformer Engine reset failed: {error!r}", RuntimeWarning, 2)


def _transformer_engine_resets() -> Iterator[Callable[[], object]]:
    for module_name in _TE_FP8_STATE_MODULES:
        manager = _loaded_function(module_name, "FP8GlobalStateManager")
        if manager is not None:
            yield manager.reset
    for module_name, name in _TE_RESETS:
        reset = _loaded_function(module_name, name)
        if reset is not None:
            yield reset
    base = sys.modules.get(_TE_UB_MODULE)
    if base is not None and _userbuffers_initialised(base):
        # Only then: destroy_ub also calls torch.compiler.reset(), which would throw away every
        # compiled function (TE's and Megatron's fused kernels) after every test.
        yield base.destroy_ub
    distributed = sys.modules.get(_TE_DISTRIBUTED_MODULE)
    if distributed is not None:
        yield lambda: _reset_te_distributed(distributed)
    end_capture = _loaded_function(_TE_GRAPH_MODULE, "set_capture_end")
    if end_capture is not None:  # a make_graphed_callables that raised leaves capture on
        yield end_capture
    for module_name in _TE_ATTENTION_MODULES:
        backends = getattr(sys.modules.get(module_name), "_attention_backends", None)
        if isinstance(backends, dict):
            # The cached backend choice depends on env vars and flags that restore may change.
            yield lambda backends=backends: backends.update(backend_selection_requires_update=True)


def _userbuffers_initialised(base: ModuleType) -> bool:
    initialised = getattr(base, "is_ub_initialized", None)
    if callable(initialised) and initialised():
        return True
    return getattr(base, "_ub_communicators", None) is not None


def _reset_te_distributed(distributed: ModuleType) -> None:
    """transformer_engine.pytorch.distributed's globals, as at import: the RNG states its
    DotProductAttention registered (a later make_graphed_callables reads them), the activation
    recompute flags and FIFO a forward without backward leaves, and the caches of group sizes
    and ranks (they keep the test's destroyed groups alive)."""
    for name in ("get_distributed_world_size", "get_distributed_rank"):
        cache_clear = getattr(getattr(distributed, name, None), "cache_clear", None)
        if cache_clear is not None:
            cache_clear()
    set_states = getattr(distributed, "set_all_rng_states", None)
    if set_states is not None:
        set_states({})
    for name, value in (
        ("_USE_REENTRANT_ACTIVATION_RECOMPUTE", True),
        ("_IN_ACTIVATION_RECOMPUTE_REGION", False),
        ("_ACTIVATION_RECOMPUTE_PHASE", False),
    ):
        if hasattr(distributed, name):
            setattr(distributed, name, value)
    recompute = getattr(distributed, "activation_recompute_forward", None)
    fifo = getattr(recompute, "_is_first_fp8_module", None)
    if isinstance(fifo, list):
        fifo.clear()
