"""Hook-point names and patch specifications, on TransformerLens's HookPoint and HookedRootModule."""
from recurscope.hooks.patches import (
    ReadoutReplace, StateReplace, WriteReplace, WriteScale, head_mask, patch_hooks, run_with_patches,
)
from recurscope.hooks.points import (
    HOOK_POINTS, HookSpec, StateHookPoint, hook_name, is_intercepted, names_for, render_markdown,
)

__all__ = ["HOOK_POINTS", "HookSpec", "ReadoutReplace", "StateHookPoint", "StateReplace", "WriteReplace", "WriteScale",
           "head_mask", "hook_name", "is_intercepted", "names_for", "patch_hooks", "render_markdown",
           "run_with_patches"]
