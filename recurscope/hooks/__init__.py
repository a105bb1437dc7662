"""Hook-point names and patch specifications, on TransformerLens's HookPoint and HookedRootModule.

TransformerLens is imported when `StateHookPoint` is first used (see hooks.points), not by `import recurscope.hooks`.
"""
from recurscope.hooks.patches import (
    ReadoutReplace, StateReplace, WriteReplace, WriteScale, head_mask, patch_hooks, run_with_patches,
)
from recurscope.hooks.points import HOOK_POINTS, HookSpec, hook_name, is_intercepted, names_for, render_markdown

__all__ = ["HOOK_POINTS", "HookSpec", "ReadoutReplace", "StateHookPoint", "StateReplace", "WriteReplace", "WriteScale",
           "head_mask", "hook_name", "is_intercepted", "names_for", "patch_hooks", "render_markdown",
           "run_with_patches"]


def __getattr__(name: str):
    if name == "StateHookPoint":   # defined on first access, with TransformerLens
        from recurscope.hooks import points

        globals()[name] = points.StateHookPoint
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
