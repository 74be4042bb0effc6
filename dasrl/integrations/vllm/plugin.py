"""The `vllm.general_plugins` entry point (pyproject: `dasrl = "dasrl.integrations.vllm.plugin:register"`).

vLLM runs every general plugin in every process it starts (the front end, the engine core, each
worker), for every user who has dasrl installed, so `register` must be cheap and change nothing unless
asked: it imports no vLLM runner code (that import alone takes ~20 s here) and patches nothing.

* vLLM 0.24-0.33: nothing to do at load time. DAS is selected per engine with
  `speculative_config={"method": "custom_class", "model": "dasrl.integrations.vllm.DASProposer", ...}`;
  the proposer installs its runner hook itself, in the worker, when vLLM constructs it.
* vLLM >= 0.34 exposes `register_speculative_method`: register a `das` method backed by DASProposer.
  Untested -- no 0.34 build could be installed here; any failure is logged and leaves vLLM as it was.
"""

from __future__ import annotations

import importlib
import logging

logger = logging.getLogger(__name__)

_REGISTRY_MODULES = ("vllm.v1.spec_decode", "vllm.config.speculative", "vllm.config", "vllm.plugins", "vllm")
"""Where a `register_speculative_method` function may live (first found wins)."""


def find_register_speculative_method():
    """vLLM's `register_speculative_method`, or None (vLLM <= 0.33, or vLLM absent)."""
    for name in _REGISTRY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        fn = getattr(module, "register_speculative_method", None)
        if callable(fn):
            return fn
    return None


def register() -> None:
    """Entry point: register the `das` speculative method where vLLM has a method registry."""
    fn = find_register_speculative_method()
    if fn is None:
        return
    from dasrl.integrations.vllm.proposer import DASProposer

    try:
        fn("das", DASProposer)
    except Exception as exc:  # an API we could not test: never break vLLM's start-up over it
        logger.warning("dasrl: register_speculative_method('das', DASProposer) failed (%s: %s); use "
                       'speculative_config={"method": "custom_class", "model": '
                       '"dasrl.integrations.vllm.DASProposer"} instead', type(exc).__name__, exc)
