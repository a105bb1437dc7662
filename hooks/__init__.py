"""Hook-point names and patch specifications, on TransformerLens's HookPoint and HookedRootModule."""
from recurscope.hooks.patches import ReadoutReplace, StateReplace, WriteReplace, WriteScale, run_with_patches
from recurscope.hooks.points import HOOK_POINTS, HookSpec, hook_name, names_for, render_markdown

__all__ = ["HOOK_POINTS", "HookSpec", "ReadoutReplace", "StateReplace", "WriteReplace", "WriteScale",
           "hook_name", "names_for", "render_markdown", "run_with_patches"]
