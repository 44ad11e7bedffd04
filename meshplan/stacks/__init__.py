"""Plans for the stacks people already run: torchtitan and Megatron-LM / NeMo.

``layout`` reads the uniform layout a plan follows (``StackLayout``) and checks the plan's
placements against it; ``arch`` reads the model's architecture from its transformers config;
the target modules write and read each stack's own configuration format.
"""

from meshplan.stacks.arch import ModelArch, arch_of_model, arch_of_spec
from meshplan.stacks.layout import StackLayout, check_expressible, layout_of

__all__ = ["ModelArch", "StackLayout", "arch_of_model", "arch_of_spec", "check_expressible",
           "layout_of"]
