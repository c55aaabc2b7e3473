"""What the planner measures: a block's profile and the model's, the terms of its memory model."""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit._plan._head import LMHead
from memfit._plan._time import OpCost

# [Note: The planner's memory model]
# A training step's peak is the largest of three kinds of moment (named terms, all bytes):
#   end of forward:  S + O + D_end + sum_j kept_j + y_last + T_head
#   forward before i: S + O + D_i + sum_{j<i} kept_j + x_i + F_i
#   forward of i:    S + O + D_i + sum_{j<i} kept_j + A_i
#   backward of i:   S + O + D_i + G_after_i + G_rest + sum_{j<i} kept_j + B_i
#   optimizer step:  P_opt
# S     parameters, buffers and optimizer state (per rank when sharded),
# O     what exists when the first block starts: the batch and what the embeddings keep,
# D_i   what the code between the blocks made after that and still holds when block i starts
#       (an encoder's output, a decoder's masks and positions: [Note: Memory outside the blocks]),
# F_i   the peak of the code that runs before block i (after block i-1, or the embeddings)
#       above what is alive when block i starts, x_i its input from block i-1 (ProphetNet's
#       relative positions: 20 MB of int64 temporaries where the whole step holds 2 MB),
# kept_j what block j keeps for backward under its decision, its input from block j-1 included
#       unless offloaded (its output is the next block's input, counted there; the last one is
#       y_last); its other inputs (masks, positions, the first block's input) are in O + D_j,
# T_head the peak of the head, the loss and their backward above the end-of-forward state,
# G_after_i / G_rest_i  the gradients of the blocks after i / of the parameters outside the
#       blocks that the forward used after block i started (the head's, a tied embedding's:
#       their gradients exist from the backward of that use; an embedding used only before the
#       blocks gets its gradient after them: BART's learned positions counted in every block's
#       backward over-forecast it by 3.3%),
# A_i   the peak of block i's forward on its own: its input from block i-1, its temporaries
#       and what it keeps, its output (PegasusX's staggered local attention peaks there),
# B_i   the peak of block i's forward and backward on its own (input from block i-1, what it
#       keeps, recompute, gradients of its parameters and of its input, its output's gradient;
#       not its output, which the next block released),
# P_opt the peak of the optimizer step (parameters, gradients, state and its temporaries), plus
#       L, what the step's forward leaves alive beside them (a mask a model caches, 4 KiB on Llama),
# and after the blocks' backward, the backward of what comes before them (the embeddings):
#   backward before the blocks:  S + G_blocks + T_tail
# T_tail what that backward holds above S and the blocks' gradients: the gradients outside the
#       blocks and its temporaries (a tied embedding's gradient is summed: three copies at once).
# Every term is measured with MemoryMeter on the example batch, per block and per decision, on
# fake tensors (see [Note: Planning on fake tensors]); R_i, what the backward of block i holds
# beside them, comes from the measured step ([Note: What the backward holds outside the blocks]).


@dataclass
class BlockProfile:
    """One candidate block, measured on the example batch (bytes and seconds)."""

    path: str
    param_bytes: int  # its parameters (its gradients have the same size when trainable)
    grad_bytes: int
    input_bytes: int
    output_bytes: int
    kept: dict[str, int] = field(default_factory=dict)  # per decision, input included unless offloaded
    peak: dict[str, int] = field(default_factory=dict)  # B_i per decision
    forward_time: float = 0.0  # its forward with activations kept (priced)
    extra_time: dict[str, float] = field(default_factory=dict)  # added to a step per decision
    forward_peak: dict[str, int] = field(default_factory=dict)  # A_i per decision (none: 0)
    # decisions the block cannot take, with why ([Note: A decision a block cannot take])
    unavailable: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelProfile:
    blocks: list[BlockProfile]
    state_bytes: int  # S: parameters + buffers + optimizer state
    param_bytes: int
    optimizer_bytes: int
    grad_rest_bytes: int  # gradients of parameters outside the blocks
    before_blocks: int  # O
    last_output: int  # y_last
    head_transient: int  # T_head
    optimizer_peak: int  # P_opt
    tail_transient: int = 0  # T_tail: peak of the backward before the blocks, above S and the blocks' gradients
    leftover: int = 0  # L: what the forward leaves alive after backward beside S and gradients (cached masks)
    buffer_bytes: int = 0  # buffers (replicated on every rank when sharded)
    step_time: float = 0.0  # priced forward, backward and optimizer step, activations kept (s)
    step_split: tuple[float, float] = (0.0, 0.0)  # (host, device) seconds of its forward and backward
    device: str = ""  # the device profile the times are priced on
    device_source: str = ""  # where its rates come from (DeviceProfile.source)
    offload_bandwidth: float = 0.0  # the device profile's bytes per second to host memory
    workspace_bytes: int = 0  # the device profile's allocator memory beside tensors (CUDA's workspaces)
    offload_stash: int = 0  # offloaded blocks whose inputs the forward's stash holds ([Note: The offload stash])
    head: LMHead | None = None  # the LM head, when it can be chunked
    head_chunked: int | None = None  # T_head with the head and loss chunked
    head_chunked_time: float = 0.0  # seconds chunking adds to a step (the head's matmul again)
    distinct_blocks: int = 0  # blocks profiled (identical ones once)
    between: list[int] = field(default_factory=list)  # D_i per block (none: 0)
    between_end: int = 0  # D_end: at the end of forward
    forward_transient: list[int] = field(default_factory=list)  # F_i per block (none: 0)
    # G_rest_i: the gradients outside the blocks alive in block i's backward (those of the
    # parameters the forward used after block i started). None: grad_rest_bytes
    grad_rest_at: list[int] = field(default_factory=list)
    # R_i: what the step holds in block i's backward beyond the terms above (none: 0), and E_i:
    # what the backward of the code after block i holds beyond what is alive then (none: 0)
    backward_outside: list[int] = field(default_factory=list)
    after_outside: list[int] = field(default_factory=list)
    # H: the blocks' inputs other than the chain's that the measured step (every block kept)
    # frees before the end of forward, each (bytes, dies, blocks given it): dies j < n, dead as
    # block j starts; n, as the forward returns ([Note: Inputs a checkpointed block holds])
    released_inputs: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    # Mixed precision ([Note: Forecasts under mixed precision]): the parameters as the shards
    # hold them, in their own dtype (0: they compute in it, no mixed precision); bytes of a
    # gradient's shard (the shards' dtype) and of its reduce buffer (the reduce dtype) per byte
    # of the gradient the compute makes (the compute dtype), over all trainable parameters.
    master_bytes: int = 0
    grad_shard_scale: float = 1.0
    reduce_scale: float = 1.0
    compute: str = ""  # what the step computes in under mixed precision (tables say it); "": the model's dtypes
    # The root's reduce (sharded): every trainable parameter outside the blocks, used by the step
    # or not (a parameter without a gradient sends zero rows), in the compute dtype and in the
    # root's reduce dtype. None: the gradients the step made (grad_rest_bytes).
    root_grad_bytes: int | None = None
    root_reduce_bytes: int | None = None
    # Gradients accumulate over micro-batches (autoconfigure's held_gradients): the root's shard
    # from the micro-batches before is alive at its reduce too.
    accumulating: bool = False
    # Every op of the measured step (forward, backward, optimizer step), as traced for the device
    # profile's target ([Note: The target's op stream]); the blocks' recomputes are in their own.
    step_ops: list[OpCost] = field(default_factory=list)

    @property
    def measured_state(self) -> int:
        """S as the measured step counted it: the parameters it computed with (under mixed
        precision the compute copies, without the optimizer, which steps on the shards)."""
        return self.param_bytes if self.master_bytes else self.state_bytes


def block_names(profile: ModelProfile) -> list[str]:
    """Each block's name in the forecast's moments: its path, "#k" after it for the k-th call
    of a module run several times ([Note: A module run several times])."""
    names: list[str] = []
    seen: dict[str, int] = {}
    for b in profile.blocks:
        seen[b.path] = seen.get(b.path, 0) + 1
        names.append(b.path if seen[b.path] == 1 else f"{b.path} #{seen[b.path]}")
    return names
