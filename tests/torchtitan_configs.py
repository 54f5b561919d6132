"""torchtitan config functions of the tests' own (``--module torchtitan_configs``: ``tests/`` is the launcher's
path), as a user's registry would hold them."""

from __future__ import annotations

from torchtitan.models.deepseek_v3 import config_registry as deepseek_v3


def deepseek_v3_debugmodel_ce_loss():
    """torchtitan's DeepSeek-V3 debug model (MoE: 8 routed experts, top 3, and 2 shared, in 5 of its 6 layers)
    with the loss ACCO's config takes: the chunked loss's own loss function (llama3 has this config already,
    ``llama3_debugmodel_ce_loss``)."""
    config = deepseek_v3.deepseek_v3_debugmodel()
    config.loss = config.loss.loss_fn
    return config
