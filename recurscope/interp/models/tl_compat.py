"""TransformerLens's user-facing surface on both model kinds, so that TransformerLens habits and tools work as they
are: the config names (`cfg.n_layers`, `n_heads`, `d_model`, `d_head`, `d_vocab`, `n_ctx`), `to_tokens`,
`to_str_tokens`, `to_string`, `W_E`, `W_U`, `forward(..., return_type=)`, `run_with_cache` returning an
`ActivationCache` (with state and readout accessors), and `generate` on the recurrent cache.

What the names mean here: a "head" is a state head of a recurrent layer (what `heads()` lists and every
intervention patches), so `n_heads` is the number of state heads per recurrent layer and `d_head` its key size K
(the state of a head is K x V). `n_ctx` is the longest context the model was configured for
(`max_position_embeddings`); the recurrent layers themselves have no limit.
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F

RETURN_TYPES = ("logits", "loss", "both", None)


class TLConfigAliases:
    """TransformerLens's config names as read-only aliases of a model config's own fields."""

    default_prepend_bos = False     # recurscope's models were trained without a BOS token
    n_key_value_heads = None        # TransformerLens reads it when patching attention K/V; no state head has one
    device: Optional[torch.device] = None   # the model sets it when moved (TransformerLensMethods._apply)

    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def d_model(self) -> int:
        return self.hidden_size

    @property
    def n_heads(self) -> int:
        """State heads per recurrent layer (value heads for grouped Gated DeltaNet)."""
        return self.state_heads

    @property
    def d_head(self) -> int:
        """The key size K of a head's K x V state."""
        return self.state_shape()[0]

    @property
    def d_vocab(self) -> int:
        return self.vocab_size

    @property
    def d_vocab_out(self) -> int:
        return self.vocab_size

    @property
    def n_ctx(self) -> Optional[int]:
        return self.max_position_embeddings


def _sample(logits: torch.Tensor, do_sample: bool, temperature: float, top_k: Optional[int],
            top_p: Optional[float], generator: Optional[torch.Generator]) -> torch.Tensor:
    """(B, V) logits -> (B,) next tokens: argmax, or a sample from softmax(logits / temperature) restricted to the
    top_k tokens and to the smallest set whose probability reaches top_p."""
    if not do_sample or temperature == 0.0:
        return logits.argmax(-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(int(top_k), logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        before = ordered.softmax(-1).cumsum(-1) - ordered.softmax(-1)   # mass of the tokens ranked above each
        ordered = ordered.masked_fill(before >= top_p, float("-inf"))   # keeps the top token always
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]


class TransformerLensMethods:
    """TransformerLens's methods in terms of `forward`, `tokenizer`, `unembed_weight` and `_embedding()`."""

    # ---- tokens ---------------------------------------------------------------------------------------------
    def _require_tokenizer(self, what: str):
        if self.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, and this model has none; set model.tokenizer (load_model "
                             "sets the checkpoint's own)")
        return self.tokenizer

    def _bos(self, prepend_bos: Optional[bool]) -> Optional[int]:
        prepend = self.cfg.default_prepend_bos if prepend_bos is None else prepend_bos
        if not prepend:
            return None
        bos = getattr(self._require_tokenizer("prepend_bos"), "bos_token_id", None)
        if bos is None:
            raise ValueError("prepend_bos=True, but the tokenizer has no bos_token_id; pass prepend_bos=False")
        return int(bos)

    def to_tokens(self, input: Union[str, Sequence[str]], prepend_bos: Optional[bool] = None,
                  padding_side: Optional[str] = None, move_to_device: bool = True, truncate: bool = False
                  ) -> torch.Tensor:
        """Text (a string or a list of strings) -> token ids (B, T), without BOS unless `prepend_bos=True`. Rows of
        unequal length are padded with the tokenizer's pad token on `padding_side` (default right): every
        recurscope model is causal, so a right-padded row's logits up to its own end are those of the row alone."""
        tok = self._require_tokenizer("to_tokens")
        texts = [input] if isinstance(input, str) else list(input)
        if not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("to_tokens takes a string or a non-empty list of strings")
        for t in texts:
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as err:   # a lone surrogate such as '\ud800' (the tokenizer raised its own)
                raise ValueError(f"to_tokens: the text holds {t[err.start]!r} at index {err.start}, a lone surrogate "
                                 "that is not a character; pass valid Unicode text (decode bytes with "
                                 "errors='replace')") from None
        bos = self._bos(prepend_bos)
        rows = [([] if bos is None else [bos]) + list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
        if truncate and self.cfg.n_ctx is not None:
            rows = [r[: self.cfg.n_ctx] for r in rows]
        width = max(len(r) for r in rows)
        if width == 0:
            raise ValueError("to_tokens: the text gives no tokens")
        side = padding_side or "right"
        if side not in ("left", "right"):
            raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        pad = getattr(tok, "pad_token_id", None)
        if any(len(r) < width for r in rows) and pad is None:
            raise ValueError("to_tokens: texts of unequal length need a pad token, and the tokenizer has none; "
                             "tokenize them one at a time")
        padded = [r + [pad] * (width - len(r)) if side == "right" else [pad] * (width - len(r)) + r for r in rows]
        tokens = torch.tensor(padded, dtype=torch.long)
        return tokens.to(self.unembed_weight.device) if move_to_device else tokens

    def to_string(self, tokens) -> Union[str, list[str]]:
        """Token ids (T,) -> text; (B, T) -> one text per row."""
        tok = self._require_tokenizer("to_string")
        tokens = self._check_ids(tokens, "to_string")
        if tokens.dim() == 2:
            return [tok.decode(row.tolist()) for row in tokens]
        return tok.decode(tokens.reshape(-1).tolist())

    def _check_ids(self, tokens, what: str) -> torch.Tensor:
        """Token ids as a (T,) or (B, T) integer tensor, each in [0, d_vocab): else a ValueError naming the problem."""
        try:
            tokens = torch.as_tensor(tokens)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"{what} takes token ids (a (T,) or (B, T) integer tensor or list), got "
                             f"{type(tokens).__name__}") from None
        if tokens.dim() not in (1, 2) or tokens.is_floating_point() or tokens.is_complex() \
                or tokens.dtype == torch.bool:
            raise ValueError(f"{what} takes token ids of shape (T,) or (B, T) and an integer dtype, got shape "
                             f"{tuple(tokens.shape)} and {tokens.dtype}; pass one row or a batch of rows")
        vocab = self.cfg.d_vocab
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab):
            bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
            raise ValueError(f"{what}: token id {bad} is outside the vocabulary [0, {vocab}); pass ids this model's "
                             "tokenizer made")
        return tokens

    def to_str_tokens(self, input, prepend_bos: Optional[bool] = None) -> Union[list[str], list[list[str]]]:
        """Each token as its own string: of a text (tokenised as `to_tokens` does), or of token ids (T,) / (1, T);
        a list of texts or (B, T) ids gives one list per row."""
        tok = self._require_tokenizer("to_str_tokens")
        if isinstance(input, (list, tuple)) and input and isinstance(input[0], str):
            return [self.to_str_tokens(text, prepend_bos) for text in input]
        tokens = self.to_tokens(input, prepend_bos, move_to_device=False) if isinstance(input, str) \
            else torch.as_tensor(input)
        if tokens.dim() == 2 and tokens.shape[0] > 1:
            return [[tok.decode([t]) for t in row.tolist()] for row in tokens]
        return [tok.decode([t]) for t in tokens.reshape(-1).tolist()]

    def to_single_token(self, string: str) -> int:
        tokens = self.to_tokens(string, prepend_bos=False, move_to_device=False)[0]
        if len(tokens) != 1:
            raise ValueError(f"{string!r} is {len(tokens)} tokens, not one")
        return int(tokens[0])

    # ---- weights --------------------------------------------------------------------------------------------
    @property
    def W_E(self) -> torch.Tensor:
        """(d_vocab, d_model): the token embedding."""
        return self._embedding().weight

    @property
    def W_U(self) -> torch.Tensor:
        """(d_model, d_vocab): the LM head, applied after the final norm (`unembed`)."""
        return self.unembed_weight.T

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        cfg = self.__dict__.get("cfg")
        param = next(self.parameters(), None)
        if cfg is not None and param is not None:
            cfg.device = param.device   # TransformerLens's tools allocate their results on cfg.device
        return out

    # ---- forward's TransformerLens arguments -----------------------------------------------------------------
    def _input_tokens(self, tokens, prepend_bos: Optional[bool] = None, padding_side: Optional[str] = None
                      ) -> torch.Tensor:
        """The forward's input as (B, T) integer ids: text goes through `to_tokens`, (T,) becomes one row."""
        if isinstance(tokens, str) or (isinstance(tokens, (list, tuple)) and tokens and isinstance(tokens[0], str)):
            tokens = self.to_tokens(tokens, prepend_bos, padding_side)
        if not isinstance(tokens, torch.Tensor):
            raise ValueError(f"tokens must be an integer tensor of shape (B, T) or text, got {type(tokens).__name__}")
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dtype not in (torch.long, torch.int32, torch.int64):
            raise ValueError(f"tokens must be an integer tensor of shape (B, T), got dtype {tokens.dtype}")
        if tokens.dim() != 2 or 0 in tokens.shape:
            raise ValueError(f"tokens must be an integer tensor of shape (B, T) with B, T >= 1, got shape "
                             f"{tuple(tokens.shape)}; pass at least one row of at least one token")
        return tokens

    @staticmethod
    def _check_state_positions(state_positions, T: int) -> None:
        """state_positions: integer positions in [0, T) (a float such as 2.5 was truncated or ignored before)."""
        if state_positions is None:
            return
        items = list(state_positions) if hasattr(state_positions, "__iter__") else [state_positions]

        def index(p):
            if isinstance(p, bool) or (isinstance(p, torch.Tensor) and p.dtype == torch.bool):
                return None
            try:
                return operator.index(p)     # ints, numpy and 0-d integer tensors; never 2.5
            except TypeError:
                return None
        values = [index(p) for p in items]
        if any(v is None or not 0 <= v < T for v in values):
            raise ValueError(f"state_positions must be integer positions in [0, {T}) of this run's tokens, got "
                             f"{state_positions!r}; e.g. state_positions=[{T - 1}]")

    @staticmethod
    def _check_return_type(return_type) -> None:
        if return_type not in RETURN_TYPES:
            raise ValueError(f"return_type must be one of {RETURN_TYPES}, got {return_type!r}")

    def _output(self, logits: torch.Tensor, tokens: torch.Tensor, return_type, loss_per_token: bool,
                logit_positions, cache=None, use_cache: bool = False):
        """The forward's return value for `return_type` ('logits', 'loss', 'both' or None), with the cache after
        it when `use_cache`. The loss is TransformerLens's: next-token cross-entropy over the call's tokens."""
        if return_type in ("loss", "both") and logit_positions is not None:
            raise ValueError("return_type='loss' needs logits at every position; drop logit_positions")
        if return_type is None:
            out = None
        elif return_type == "logits":
            out = logits
        else:
            log_probs = F.log_softmax(logits[:, :-1].float(), dim=-1)
            nll = -log_probs.gather(-1, tokens[:, 1:, None])[..., 0]
            loss = nll if loss_per_token else nll.mean()
            out = loss if return_type == "loss" else (logits, loss)
        return (out, cache) if use_cache else out

    # ---- generation -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input: Union[str, Sequence[str], torch.Tensor] = "", max_new_tokens: int = 10,
                 stop_at_eos: bool = True, eos_token_id: Optional[int] = None, do_sample: bool = True,
                 top_k: Optional[int] = None, top_p: Optional[float] = None, temperature: float = 1.0,
                 use_past_kv_cache: bool = True, prepend_bos: Optional[bool] = None,
                 padding_side: Optional[str] = None, return_type: Optional[str] = "input",
                 generator: Optional[torch.Generator] = None, verbose: bool = False):
        """TransformerLens's generate on the recurrent cache: the prompt runs once into a `RecurrentCache` (states,
        conv tails, attention K/V), then each new token is one step from it (`use_past_kv_cache=False` reruns the
        whole sequence instead). Greedy with `do_sample=False`; otherwise a sample at `temperature`, within
        `top_k` / `top_p`, drawn with `generator`. Returns the prompt and the new tokens: as text for text input
        (`return_type="input"` or "str"), as ids (B, T + new) for ids or `return_type="tokens"`. A row that has
        produced the EOS token (`eos_token_id`, default the tokenizer's) continues with EOS; generation stops
        when every row has, if `stop_at_eos`."""
        if return_type not in ("input", "str", "tokens"):
            raise ValueError(f"return_type must be 'input', 'str' or 'tokens', got {return_type!r}")
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)
        if not is_int(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"generate: max_new_tokens must be an integer >= 0, got {max_new_tokens!r}; e.g. "
                             "max_new_tokens=10")
        if top_k is not None and (not is_int(top_k) or top_k < 1):
            raise ValueError(f"generate: top_k must be an integer >= 1 (or None), got {top_k!r}; e.g. top_k=50")
        if eos_token_id is not None and (not is_int(eos_token_id) or not 0 <= eos_token_id < self.cfg.d_vocab):
            raise ValueError(f"generate: eos_token_id must be a token id in [0, {self.cfg.d_vocab}) (or None for "
                             f"the tokenizer's), got {eos_token_id!r}")
        if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
                or not math.isfinite(temperature) or temperature < 0:
            raise ValueError(f"generate: temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
        if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise ValueError(f"generate: top_p must be in (0, 1] (or None), got {top_p!r}")
        text_input = isinstance(input, str) or (isinstance(input, (list, tuple)) and input
                                                and isinstance(input[0], str))
        if text_input and not isinstance(input, str):
            lengths = {len(self.to_tokens(text, prepend_bos, move_to_device=False)[0]) for text in input}
            if len(lengths) > 1:   # no attention mask: a padded row would read its padding as text
                raise ValueError(f"generate: the prompts have {sorted(lengths)} tokens; generate prompts of one "
                                 "length together, or one at a time")
        tokens = self._input_tokens(input, prepend_bos, padding_side)
        if eos_token_id is None and stop_at_eos:
            eos_token_id = getattr(self.tokenizer, "eos_token_id", None)
        B, T = tokens.shape
        finished = torch.zeros(B, dtype=torch.bool, device=tokens.device)
        last = torch.full((B,), T - 1, dtype=torch.long, device=tokens.device)
        logits, cache = self(tokens, use_cache=True, logit_positions=last) if use_past_kv_cache \
            else (self(tokens, logit_positions=last), None)
        steps = range(max_new_tokens)
        if verbose:
            from tqdm.auto import tqdm
            steps = tqdm(steps)
        out = [tokens]
        for _ in steps:
            new = _sample(logits, do_sample, temperature, top_k, top_p, generator)
            if stop_at_eos and eos_token_id is not None:
                new = new.masked_fill(finished, int(eos_token_id))
                finished |= new == int(eos_token_id)
            out.append(new[:, None])
            if stop_at_eos and eos_token_id is not None and bool(finished.all()):
                break
            if use_past_kv_cache:
                step_logits, cache = self(new[:, None], cache=cache, use_cache=True)
                logits = step_logits[:, -1]
            else:
                seq = torch.cat(out, dim=1)
                logits = self(seq, logit_positions=torch.full((B,), seq.shape[1] - 1, device=seq.device))
        result = torch.cat(out, dim=1)
        if return_type == "str" or (return_type == "input" and text_input):
            texts = self.to_string(result)
            return texts[0] if isinstance(input, str) else texts
        return result
