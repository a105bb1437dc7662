"""The shape of a recall prompt, named once: how many bindings, how often each is presented, how much filler lies
where, and which fact/query template says them. The CLI builds a PairLayout and hands it to `iter_pairs` as is.

Named layouts (LAYOUTS):
- "paper": How Linear Attention Remembers, App. B: 4 bindings x 3 presentations, 512 filler tokens before the query
  and a single-token query. recurscope reads "single-token query" as: the query is the key itself, one token, and
  the next token is the answer, so the query-time output of a head is the output at that one position. The facts
  are written "KEY VALUE." (template "key_value"), so the key is followed by its value wherever it is presented.
- "where_is": the layout recurscope used before (and that the bundled checkpoints were evaluated on): the same
  bindings, presentations and filler, with the 7-token query "where is KEY? KEY is in" (template "is_in").
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

__all__ = ["PairLayout", "LAYOUTS", "DEFAULT_LAYOUT", "resolve_layout", "LAYOUT_FILE", "recorded_layout",
           "choose_layout"]

#: The file in a checkpoint directory that records the layout the model was trained and evaluated on.
LAYOUT_FILE = "pair_layout.json"


@dataclass(frozen=True)
class PairLayout:
    """One recall prompt layout: [BOS] lead filler, then `presentations` rounds presenting each of the `n_facts`
    facts once (order shuffled per round) with `gap_tokens` of filler after each, the last followed by
    `filler_tokens` of filler instead, then the template's query. `lead_tokens` None means `gap_tokens`."""

    name: str = "custom"
    n_facts: int = 4
    presentations: int = 3
    filler_tokens: int = 512
    gap_tokens: int = 24
    lead_tokens: int | None = None
    template: str = "is_in"

    def __post_init__(self) -> None:
        for field_name, minimum in (("n_facts", 1), ("presentations", 1), ("filler_tokens", 0), ("gap_tokens", 0)):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"PairLayout.{field_name} must be an integer >= {minimum}; received {value!r}.")
        if self.lead_tokens is not None and (not isinstance(self.lead_tokens, int) or self.lead_tokens < 0):
            raise ValueError(f"PairLayout.lead_tokens must be None or an integer >= 0; received {self.lead_tokens!r}.")

    def with_(self, **changes) -> "PairLayout":
        """A copy with the given fields changed (None values are ignored, so CLI options left unset keep the
        layout's own value); the name becomes "<name>+changes" when a value actually differs."""
        changes = {k: v for k, v in changes.items() if v is not None}
        differs = {k: v for k, v in changes.items() if getattr(self, k) != v}
        if not differs:
            return self
        return replace(self, **differs, name=self.name if self.name.endswith("+custom") else f"{self.name}+custom")

    def to_dict(self) -> dict:
        return asdict(self)


LAYOUTS: dict[str, PairLayout] = {
    "paper": PairLayout(name="paper", template="key_value"),
    "where_is": PairLayout(name="where_is", template="is_in"),
}

#: The layout of a checkpoint that records none.
DEFAULT_LAYOUT = "paper"


def resolve_layout(layout: "str | PairLayout | dict") -> PairLayout:
    """A PairLayout from a name in LAYOUTS, a dict of its fields, or a PairLayout."""
    if isinstance(layout, PairLayout):
        return layout
    if isinstance(layout, dict):
        known = set(PairLayout.__dataclass_fields__)
        unknown = sorted(set(layout) - known)
        if unknown:
            raise ValueError(f"layout fields {unknown} are not PairLayout fields ({sorted(known)}).")
        return PairLayout(**layout)
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {sorted(LAYOUTS)} or a PairLayout; received {layout!r}.")
    return LAYOUTS[layout]


def recorded_layout(directory) -> PairLayout | None:
    """The layout a checkpoint directory records in pair_layout.json, or None when it records none."""
    if directory is None:
        return None
    from recurscope.interp.checkpoint_files import CheckpointError, read_regular

    path = Path(directory) / LAYOUT_FILE
    if not os.path.lexists(path) or (path.is_symlink() and not path.exists()):
        return None
    try:   # a FIFO or device is refused at once (it would block, or be skipped as "no layout")
        return resolve_layout(json.loads(read_regular(path, "the checkpoint's pair layout", limit=1 << 20)))
    except CheckpointError:
        raise
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: not a pair layout ({err}); fix or delete the file (the default is "
                         f"--layout {DEFAULT_LAYOUT}).") from None


def choose_layout(name: "str | None" = None, checkpoint_dir=None, **overrides) -> PairLayout:
    """The layout of a command-line run: the named one (`--layout`), else the one `checkpoint_dir` records, else
    DEFAULT_LAYOUT; `overrides` (PairLayout fields; None values ignored) change its fields."""
    base = (resolve_layout(name) if name else recorded_layout(checkpoint_dir) or resolve_layout(DEFAULT_LAYOUT))
    return base.with_(**overrides)
