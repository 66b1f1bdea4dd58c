"""Multi-LoRA serving: PEFT adapters beside one base model, chosen per request.

- `adapter`: read and check a PEFT adapter directory against the base model;
- `stack`: every adapter's weights on the device, laid out per layer and fused projection, and
  the per-step application of the deltas to the rows of the requests that chose them.
"""

from engine.lora.adapter import LoRAAdapter, LoRAError, load_adapter
from engine.lora.stack import LoRABatch, LoRAStack
from engine_api.lora import LoRARequest, lora_name_of

__all__ = ["LoRAAdapter", "LoRABatch", "LoRAError", "LoRARequest", "LoRAStack", "load_adapter",
           "lora_name_of"]
