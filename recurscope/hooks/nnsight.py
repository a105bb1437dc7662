"""nnsight interoperability: `RecurscopeNNsight` wraps a recurscope model so that nnsight traces can read and write
every hook point, and batches several invokes (equal-length token tensors) into one forward for donor/recipient patches.
"""
from __future__ import annotations

from typing import Any

import torch
from nnsight import NNsight

_TOKENS = "tokens"   # the forward's only per-row argument; every other one must agree across invokes


def _as_token_rows(tokens: Any, where: str) -> torch.Tensor:
    if not isinstance(tokens, torch.Tensor) or tokens.dtype not in (torch.int32, torch.int64):
        got = type(tokens).__name__ if not isinstance(tokens, torch.Tensor) else f"a {tokens.dtype} tensor"
        raise ValueError(f"{where}: tokens must be an integer torch tensor of shape (B, T) or (T,), got {got}; "
                         "tokenize text first (e.g. tokenizer(text, return_tensors='pt').input_ids)")
    if tokens.dim() == 1:
        return tokens[None]
    if tokens.dim() != 2:
        raise ValueError(f"{where}: tokens must have shape (B, T) or (T,), got shape {tuple(tokens.shape)}")
    return tokens


def _normalise(key: str, value: Any) -> Any:
    """A comparable form of a forward argument (state positions as a sorted tuple, as the mixers use them)."""
    if key == "state_positions" and value is not None:
        return tuple(sorted({int(p) for p in value}))
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    return a == b


class StateNotCapturedError(ValueError):
    """A trace read or wrote `blocks.{l}.mixer.hook_state`, which never fired: no `state_positions` were given (or
    the invoke asked for something later in the forward first)."""


class RecurscopeNNsight(NNsight):
    """`nnsight.NNsight` for a recurscope model (`RecurrentLM`, or `BridgedLM` on a transformers checkpoint) in which several invokes (token tensors of equal length) run
    as one batch, each invoke seeing only its own rows. (A plain `NNsight(model)` reads and writes every hook point
    too: the mixers call each of them on every forward; it only cannot batch several invokes.)

        model_nn = RecurscopeNNsight(model)
        with model_nn.trace(state_positions=[t]) as tracer:
            barrier = tracer.barrier(2)   # the donor's read must happen before the recipient's write
            with tracer.invoke(donor_tokens):
                donor = model_nn.blocks[l].mixer.hook_state.output[:, 0].clone().save()
                barrier()
            with tracer.invoke(recipient_tokens):
                barrier()
                model_nn.blocks[l].mixer.hook_state.output[:, 0, head] = donor[:, head]
                logits = model_nn.output.save()

    An invoke that hands a value to another needs such a barrier (see docs/nnsight.md).
    Forward arguments (`state_positions`, `use_cache`) go to `trace(...)` or to each invoke; given in several
    invokes they must agree, since all invokes share one forward call. A `cache` is accepted only with one invoke.
    """

    def __init__(self, model: torch.nn.Module, **kwargs: Any):
        if not hasattr(model, "hook_dict") or not hasattr(model, "recurrent_layers"):
            raise ValueError(f"model: expected a recurscope model (a hooked model with hook_dict and "
                             f"recurrent_layers: RecurrentLM or BridgedLM), got {type(model).__name__}; build one "
                             "with interp.models.RecurrentLM or interp.loading.load_model")
        super().__init__(model, **kwargs)

    def interleave(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """nnsight's driver of a trace, with nnsight's OutOfOrderError for a `hook_state` that never fired
        reworded: that point fires only at the requested `state_positions`."""
        try:
            return super().interleave(fn, *args, **kwargs)
        except Exception as err:
            if type(err).__name__ == "OutOfOrderError" and ".hook_state." in str(err):
                raise StateNotCapturedError(
                    f"{str(err).splitlines()[0]}: hook_state fires only at the positions named by state_positions; "
                    "pass them to the trace (model_nn.trace(tokens, state_positions=[t])), and within one invoke read "
                    "hook_state before anything later in the forward (docs/nnsight.md)") from err
            raise

    # ---- batching several invokes ----------------------------------------------------------------------
    def _batch_size(self, *inputs: Any, **kwargs: Any) -> int:
        """Rows of token ids this input contributes; 0 for forward arguments alone (e.g. trace(state_positions=..))."""
        tokens = inputs[0] if inputs else kwargs.get(_TOKENS)
        if tokens is None:
            return 0
        return _as_token_rows(tokens, "RecurscopeNNsight input").shape[0]

    def _batch(self, invokes: list[tuple], fn: Any) -> tuple:
        """Stacks the invokes' token rows into one (B, T) tensor; the other forward arguments must agree."""
        if not invokes:
            return tuple(), {}
        if len(invokes) == 1:
            return invokes[0]
        rows, shared, lengths = [], {}, []
        for i, (inputs, kwargs) in enumerate(invokes, start=1):
            inputs, kwargs = list(inputs), dict(kwargs)
            tokens = inputs.pop(0) if inputs else kwargs.pop(_TOKENS)
            if inputs:
                raise ValueError(f"invoke {i}: pass only the token tensor positionally, got {len(inputs) + 1} "
                                 "positional arguments; give forward options by name (state_positions=...)")
            if kwargs.get("cache") is not None:
                raise ValueError(f"invoke {i}: cache= cannot be batched across several invokes; run one invoke per "
                                 "trace when continuing from a RecurrentCache")
            for key, value in kwargs.items():
                value = _normalise(key, value)
                if key in shared and not _same(shared[key], value):
                    raise ValueError(f"invoke {i}: {key}={value!r} differs from an earlier invoke's {shared[key]!r}; "
                                     f"all invokes of one trace share one forward call, so pass {key} once to "
                                     "trace(...) or the same value to every invoke")
                shared[key] = value
            token_rows = _as_token_rows(tokens, f"invoke {i}")
            rows.append(token_rows)
            lengths.append(token_rows.shape[1])
        if len(set(lengths)) > 1:
            raise ValueError(f"invokes must have token tensors of equal length to share one batched forward "
                             f"(position t must name the same step in every row); got lengths {lengths}. "
                             "Crop or pad the inputs to one length, or run them in separate traces")
        if "state_positions" in shared and shared["state_positions"] is not None:
            shared["state_positions"] = list(shared["state_positions"])
        return (torch.cat(rows, dim=0),), shared
