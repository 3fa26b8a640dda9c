"""The Gated DeltaNet peer: transformers' ``Qwen3_5ForCausalLM`` text model behind a thin adapter
(:class:`GatedDeltaNetForCausalLM`). Built by ``bilinear_lm.baselines`` (which registers it with the Auto classes);
``save_pretrained`` copies this file and its relative imports as remote code, so a saved model loads with
``trust_remote_code=True`` without this package (lm-eval's ``--model hf``)."""
from transformers import DynamicCache, Qwen3_5ForCausalLM
from transformers.models.qwen3_5 import modeling_qwen3_5

from .configuration_gated_deltanet import DT_BIAS_INITS, GatedDeltaNetConfig
from .initialization import init_time_step_bias_
from .transformers_compat import CACHE_NAME


class PositionCountingCache(DynamicCache):
    """transformers' ``DynamicCache`` that counts the positions it has seen (``GatedDeltaNetForCausalLM.forward``
    advances it): Qwen3.5's linear-attention cache layers count none, and without an attention layer
    ``get_seq_length`` raised (in training, where the model builds a cache, and in ``generate``)."""

    def __init__(self, config):
        super().__init__(config=config)
        self.positions = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.positions

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        """A full attention layer's key length and offset (Qwen3.5 has no sliding layers)."""
        return self.positions + query_length, 0


def _beta_doubled(rule):
    def rule_with_doubled_beta(*args, beta, **kwargs):
        return rule(*args, beta=2 * beta, **kwargs)

    return rule_with_doubled_beta


_DELTA_RULES = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def _swap_in_doubled_beta(module, args) -> None:
    """A ``Qwen3_5GatedDeltaNet``'s forward pre-hook: transformers' layer computes ``beta = sigmoid(b)`` and passes it
    to module-level delta rules, swapped here, for its call, for rules that get ``2 * beta`` (a recomputation under
    gradient checkpointing calls the hooks again). Not thread-safe: one forward at a time per process."""
    module._delta_rules = {name: getattr(modeling_qwen3_5, name) for name in _DELTA_RULES}
    for name, rule in module._delta_rules.items():
        setattr(modeling_qwen3_5, name, _beta_doubled(rule))


def _restore_delta_rules(module, args, output) -> None:
    """The matching forward hook (``always_call``: also when the forward raises): transformers' rules back."""
    for name, rule in module.__dict__.pop("_delta_rules", {}).items():
        setattr(modeling_qwen3_5, name, rule)


class GatedDeltaNetForCausalLM(Qwen3_5ForCausalLM):
    """transformers' ``Qwen3_5ForCausalLM`` (text model) as the Gated DeltaNet baseline, adapted in three places and
    otherwise transformers' code: a :class:`PositionCountingCache` (an all-linear layout trains and generates; no
    cache in training unless asked), ``config.allow_neg_eigval`` (``beta = 2 sigmoid(b)`` in every Gated DeltaNet
    layer, :class:`GatedDeltaNetConfig`) and ``dt_bias`` initialized as the Gated DeltaNet paper's code does for
    training from scratch (:func:`init_time_step_bias_`: a head's decay per token at init, ``exp(-A softplus(dt_bias))``
    with ``A ~ U(0, 16)``, is ``exp(-A dt)``, dt log-uniform in (0.001, 0.1), mostly near 1), not as Qwen3.5's, whose
    weights are meant to be loaded: its ``dt_bias = 1`` gives ``exp(-1.31 A)``, e^-10 for the median head, a state that
    forgets at once. ``dt_bias_init="qwen3_5"`` keeps Qwen3.5's: it scored better on Gutenberg (docs/peers/), so
    that table has both; the paper's stays the default, the field's from-scratch initialization, for every task.
    ``from_pretrained`` loads the saved value over either."""

    config_class = GatedDeltaNetConfig

    def __init__(self, config: GatedDeltaNetConfig):
        if config.dt_bias_init not in DT_BIAS_INITS:
            raise ValueError(f"dt_bias_init must be one of {DT_BIAS_INITS}, got {config.dt_bias_init!r}")
        super().__init__(config)
        for layer in self.model.layers:
            if (delta_rule := getattr(layer, "linear_attn", None)) is None:
                continue  # a full-attention layer
            if config.dt_bias_init == "paper":
                init_time_step_bias_(delta_rule.dt_bias)
            if config.allow_neg_eigval:  # hooks, not a wrapped forward: a deep copy of the model keeps them right
                delta_rule.register_forward_pre_hook(_swap_in_doubled_beta)
                delta_rule.register_forward_hook(_restore_delta_rules, always_call=True)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() would build a plain DynamicCache: forward builds a PositionCountingCache

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, *, inputs_embeds=None, use_cache=None,
                **kwargs):
        """``Qwen3_5ForCausalLM.forward`` (the rest by keyword), with a :class:`PositionCountingCache` built where a
        cache is used and none is given (training uses none unless ``use_cache=True``)."""
        cache = kwargs.get(CACHE_NAME, kwargs.get("past_key_values"))  # the old name: transformers' warning, later
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and cache is None:
            cache = kwargs[CACHE_NAME] = PositionCountingCache(self.config)
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        if isinstance(cache, PositionCountingCache):
            cache.positions += (input_ids if input_ids is not None else inputs_embeds).shape[1]
        return out
