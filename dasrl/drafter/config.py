"""StoreConfig's old home: it lives in dasrl.drafter.store now (dasrl.integrations.vllm.config imports it from here)."""

from dasrl.drafter.store import MODES, StoreConfig  # noqa: F401
