"""The engine's LoRA adapters: their runner slots, the KV hash roots their prompts chain from,
and their loading and unloading while the engine runs (`LoRAConfig.max_loras` slots)."""

from __future__ import annotations

import collections
import logging

from engine.config import ConfigError, EngineConfig, LoRAConfig, ModelConfig
from engine.lora import LoRAAdapter, LoRAError, LoRAStack, load_adapter
from engine.runner import ModelRunner
from engine.scheduler import Scheduler
from engine_api.errors import EngineInputError
from engine_api.hashing import root_hash, salted_root

logger = logging.getLogger(__name__)


class LoRAAdmin:
    """One engine's adapters by name. `LLMEngine` forwards its LoRA methods here; adding and
    removing run on the engine thread, the lookups (`slot`, `hash_root`) on any thread."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, runner: ModelRunner,
                 scheduler: Scheduler, fingerprint: bytes) -> None:
        self._config = config
        self._model_config = model_config
        self._runner = runner
        self._scheduler = scheduler
        self._fingerprint = fingerprint
        # Each adapter's KV differs from the base model's for the same tokens: its prompts'
        # block hashes chain from a root of their own (the adapter's name and files), by name.
        self._roots: dict[str, bytes] = {}
        if runner.lora is not None:
            for adapter in runner.lora.adapters:
                self._roots[adapter.name] = self._root(adapter)

    # ---- lookups (any thread) --------------------------------------------------------------

    def slot(self, lora_name: str | None) -> int:
        """The runner's slot of adapter `lora_name` (0: None, the base model);
        EngineInputError naming the loaded adapters otherwise."""
        if lora_name is None:
            return 0
        stack = self._runner.lora
        if stack is None:
            raise EngineInputError(f"LoRA adapter {lora_name!r} asked for, but this engine "
                                   "serves none (start it with --lora-modules NAME=PATH or "
                                   "--max-loras N)")
        try:
            return stack.slot(lora_name)
        except KeyError:
            raise EngineInputError(f"unknown LoRA adapter {lora_name!r}; this engine serves "
                                   f"{sorted(stack.slots)}") from None

    def hash_root(self, lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
        """The root a prompt's block hashes chain from: the engine's, or adapter `lora_name`'s
        (EngineInputError for an adapter it does not serve), salted by `cache_salt`."""
        if lora_name is None:
            root = self._scheduler.kv.root
        else:
            self.slot(lora_name)
            found = self._roots.get(lora_name)
            if found is None:  # removed on the engine thread since the line above
                raise EngineInputError(f"unknown LoRA adapter {lora_name!r}")
            root = found
        return salted_root(root, cache_salt) if cache_salt else root

    def prompt_key(self, lora_name: str | None = None, cache_salt: str | None = None) -> bytes:
        """What a KV handle's prompt hash binds besides the tokens (`prompt_hash`): the
        model's fingerprint, or for an adapter's or a salted prompt its root (32 bytes)."""
        return (self.hash_root(lora_name, cache_salt) if lora_name or cache_salt
                else self._fingerprint)

    @property
    def runtime(self) -> bool:
        """Whether adapters can be added and removed while the engine runs."""
        return self._runner.lora is not None and self._runner.lora.slotted

    def names(self) -> list[str]:
        """The adapters loaded now, by slot."""
        stack = self._runner.lora
        return [] if stack is None else [a.name for a in stack.adapters]

    def requests(self) -> dict[str, tuple[int, int]]:
        """Each loaded adapter's unfinished requests: (running, waiting). Racy off the engine
        thread, as the scheduler's counts are (each collection is copied in one C call)."""
        stack = self._runner.lora
        if stack is None:
            return {}
        sched = self._scheduler
        running = collections.Counter(r.lora_slot for r in list(sched.running))
        total = collections.Counter(r.lora_slot for r in list(sched.requests.values()))
        return {a.name: (running[slot], max(total[slot] - running[slot], 0))
                for slot, a in sorted(list(stack.loaded.items()))}

    # ---- changes (engine thread) -----------------------------------------------------------

    def add(self, name: str, path: str) -> None:
        """Read the PEFT adapter in directory `path`, check it against the model and write it
        into a free slot, so requests may name it from the next step on. Engine thread only.
        EngineInputError says why it cannot be: runtime loading off, a bad name, a name
        already loaded, no free slot, or what is wrong with the files."""
        stack = self._runtime_stack()
        try:
            LoRAConfig(modules=((name, path),)).validate()
        except ConfigError as e:
            raise EngineInputError(str(e)) from None
        if name in stack.slots:
            raise EngineInputError(f"LoRA adapter {name!r} has already been loaded (from "
                                   f"{stack.loaded[stack.slots[name]].path})")
        if len(stack.loaded) >= stack.max_loras:
            raise EngineInputError(f"all {stack.max_loras} LoRA slots are taken "
                                   f"({', '.join(self.names())}); unload one first or "
                                   "start the engine with a larger max_loras")
        try:
            adapter = load_adapter(name, path, self._model_config,
                                   self._config.lora.max_lora_rank)
            root = self._root(adapter)
            tp = self._runner.tp
            if tp is None:
                slot = stack.add(adapter)
            elif not tp.add_lora(name, path, lambda: stack.add(adapter),
                                 lambda: stack.remove(name)):
                raise EngineInputError(f"LoRA adapter {name!r}: a tensor-parallel rank could "
                                       "not load its share (its log says why); no rank has it")
            else:
                slot = stack.slot(name)
        except (LoRAError, ValueError) as e:
            raise EngineInputError(str(e)) from None
        self._roots[name] = root
        logger.info("LoRA adapter %s loaded into slot %d: rank %d, %s (%s)", name, slot,
                    adapter.rank, ", ".join(sorted(adapter.targets)), path)

    def remove(self, name: str) -> None:
        """Unload adapter `name`, freeing its slot. Engine thread only. EngineInputError when
        no adapter has the name or unfinished requests still run it."""
        stack = self._runtime_stack()
        slot = stack.slots.get(name)
        if slot is None:
            raise EngineInputError(f"no LoRA adapter {name!r} is loaded (loaded: "
                                   f"{', '.join(self.names()) or 'none'})")
        users = sum(r.lora_slot == slot for r in self._scheduler.requests.values())
        if users:
            raise EngineInputError(f"LoRA adapter {name!r} is in use by {users} unfinished "
                                   "request(s); unload it once they are done")
        stack.remove(name)
        if self._runner.tp is not None:
            self._runner.tp.remove_lora(name)
        del self._roots[name]
        logger.info("LoRA adapter %s unloaded from slot %d", name, slot)

    def _runtime_stack(self) -> LoRAStack:
        stack = self._runner.lora
        if not self.runtime or stack is None:
            raise EngineInputError("this engine does not load LoRA adapters at runtime: start "
                                   "it with max_loras > 0 (--max-loras N)")
        return stack

    def _root(self, adapter: LoRAAdapter) -> bytes:
        """Adapter `adapter`'s root: a name loaded again from other files gets another, so no
        block computed with the old weights is a prefix hit for the new ones."""
        return root_hash(self._fingerprint, f"{self._config.cache.tenant_salt}\x00lora\x00"
                                            f"{adapter.name}\x00{adapter.weights_id}")
