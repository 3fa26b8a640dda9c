"""Configuration of bilinear recurrent language models. It imports nothing of the machinery it configures: names
are validated here, each transition type checks the fields it needs when it is built (``transitions.py``)."""

from transformers import PreTrainedConfig

MIXER_TYPES = ("cp", "full", "block_diagonal", "rotation", "diagonal", "positive_diagonal")  # TRANSITIONS' keys
RECURRENCE_IMPLS = ("auto", "cpp", "triton", "torch", "reference")  # what dispatch.resolve_impl chooses among
ACTIVATIONS = ("silu", "gelu", "relu")
LAYER_TYPES = ("bilinear", "full_attention", "sliding_attention")  # the values of BilinearConfig.layer_types
# config.json names a bilinear layer "linear_attention", transformers' name for a recurrent layer in `layer_types` (one
# of the types its PreTrainedConfig accepts): AutoTokenizer.from_pretrained(model_dir) reads config.json, and without
# this package (or trust_remote_code) it reads it as a plain PreTrainedConfig, which refuses any other name. Read
# back, either name is a bilinear layer.
SAVED_LAYER_TYPES = {"bilinear": "linear_attention"}


def interleaved_layer_types(num_hidden_layers: int, attention_every: int,
                            attention_type: str = "full_attention") -> list[str]:
    """``layer_types`` with every ``attention_every``-th layer an attention layer (``attention_type``) and the others
    bilinear: ``interleaved_layer_types(8, 4)`` is 3 bilinear : 1 attention, the attention layers 4th and 8th."""
    if isinstance(attention_every, bool) or not isinstance(attention_every, int) or attention_every < 1:
        raise ValueError(f"interleaved_layer_types: attention_every must be a positive integer, got {attention_every!r}")
    return [attention_type if (i + 1) % attention_every == 0 else "bilinear" for i in range(num_hidden_layers)]


def swiglu_width(hidden_size: int) -> int:
    """The SwiGLU MLP's default width: ``8/3 * hidden_size`` rounded up to a multiple of 32 (Llama's rule)."""
    return 32 * -(-8 * hidden_size // 96)


class BilinearConfig(PreTrainedConfig):
    r"""Configuration of [`BilinearModel`] / [`BilinearForCausalLM`].

    Each block is a pre-norm residual bilinear mixer followed (if `use_mlp`) by a pre-norm SwiGLU MLP.
    A mixer has `num_heads` heads; each head carries a state of size `state_size` updated with no additive
    term, `h_t = A(x_t) h_{t-1}`, where the structure of `A` is `mixer_type`:

    - `cp` (default): `A(x) = W1 diag(u(x)) W2^T` with `u(x) = Wx x + b` of size `rank` (CP-factored).
    - `full`: `A(x) = sum_k W_k u_k(x)`, one `state_size x state_size` matrix per input factor (`rank` of them).
    - `block_diagonal`: full bilinear blocks of size `block_size` on the diagonal.
    - `rotation`: 2x2 rotation/scaling blocks (a complex diagonal), each entry linear in `x`.
    - `diagonal`: a real diagonal, linear in `x` (may be negative).
    - `positive_diagonal`: a diagonal in (0, 1) (`sigmoid`), Mamba-like.

    Because the update is homogeneous in `h` and every head's output normalizes its own state, the model is
    exactly invariant to the scale of each head's state: every `norm_chunk_size` positions the state is divided
    by its (detached) norm, which keeps it finite without changing any output (`0` disables this).
    `additive_input=True` adds `B x_t` to the update (the paper's ablation); it breaks scale invariance, so
    normalization then changes the outputs.

    `recurrence_impl` picks how the CP recurrence runs (`dispatch.resolve_impl` decides; every other mixer type, and CP
    with `additive_input`, always runs the plain loop): `"cpp"` (a C++ CPU kernel), `"triton"` (Triton GPU kernels),
    `"torch"` (a PyTorch scan, any device), `"reference"` (the plain loop that specifies it) or `"auto"`: Triton on
    CUDA when it imports, the C++ kernel on CPU when it builds, else the PyTorch scan; but the plain loop for one
    position, and on CPU when `rank > 2 * state_size` (the scans work in rank space at `rank^2` per step, the loop
    at `2 * rank * state_size`).

    `conv_width > 1` puts a short causal depthwise convolution with a residual, `x + conv(x)`, on each mixer's input,
    a hybrid's attention layers included (zero-initialized, so training starts from the model without it; `0`
    disables it). It leaves the recurrence untouched: the cache also holds each layer's last `conv_width - 1`
    inputs.

    `input_factor_multiplier` scales the input factors' projection in the forward pass,
    `u(x) = factor_bias + input_factor_multiplier * (W_u x)`, with `W_u` initialized at
    `input_factor_init_std / input_factor_multiplier` (the same model at initialization). Under Adam, whose steps
    do not depend on a gradient's scale, it is the input factors' learning rate relative to the other weights':
    a per-token gain compounds over the whole sequence, so they are the model's most learning-rate-sensitive
    weights.
    `reset_state_at_eos=True` restarts every layer's state (and convolution window) after each `eos_token_id`, so
    documents packed into one training block do not see each other, exactly as if each were run alone.

    `layer_types` (one entry per layer, default all `"bilinear"`) makes a hybrid: a `"full_attention"` or
    `"sliding_attention"` layer replaces the block's mixer with causal softmax attention (transformers' attention
    interface, Llama's rotary embedding, `num_attention_heads` query heads and `num_key_value_heads` key/value heads
    of size `hidden_size / num_attention_heads`, `rope_theta` or `rope_parameters`); a sliding layer attends to the
    last `sliding_window` positions (itself included). `use_rope=False` leaves the attention layers without any
    positional encoding (NoPE, as Jamba's: the bilinear layers are ordered and give the positions); it is what lets a
    hybrid's attention generalize in length (docs/results-history.md, hybrids). The norms and the MLP are the bilinear
    blocks'.
    `interleaved_layer_types(num_hidden_layers, k)` puts attention on every k-th layer. With `reset_state_at_eos`
    the attention layers do not attend across an EOS either.

    `memory_heads > 0` adds memory heads to every bilinear mixer, beside its `num_heads` tracking heads: each holds a
    matrix `S` (`memory_value_size x memory_key_size`) and a homogeneous coordinate `c`, written by a projective gated
    delta rule `S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t c v_t k_t^T` (`alpha` in (0, 1], `beta` in
    (0, 2), unit keys; `S / c` is the gated delta rule with negative eigenvalues, a non-expansive memory) and read by a
    query, `S_t q_t / c` (RMS-normalized, not gated). Queries, keys and values pass a short causal convolution of
    `memory_conv_width` (with a residual, as `conv_width`'s); queries and keys share a small positive offset and the
    write starts weak (`beta` 0.095), so an untrained memory reads a bag of the values before it (`BilinearMemory`).
    The update has no additive term in `[S; c]`, so the chunked normalization divides the memory by its own norm
    (never jointly with the tracking state) without changing an output. The tracking heads stay the bilinear heads
    of `mixer_type`.

    `num_hidden_layers=1, use_mlp=False` is the paper's minimal model (one recurrent layer, linear readout).
    """

    model_type = "bilinear"

    vocab_size: int = 50257
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_heads: int = 4
    state_size: int = 64
    rank: int = 64
    mixer_type: str = "cp"
    block_size: int = 2
    additive_input: bool = False
    conv_width: int = 0
    memory_heads: int = 0
    memory_key_size: int = 32
    memory_value_size: int = 32
    memory_conv_width: int = 4
    reset_state_at_eos: bool = False
    norm_chunk_size: int = 64
    recurrence_impl: str = "auto"
    use_gate: bool = True
    use_mlp: bool = True
    intermediate_size: int | None = None
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    input_factor_init_std: float = 0.02
    input_factor_multiplier: float = 1.0
    layer_types: list[str] | None = None
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    sliding_window: int | None = None
    rope_parameters: dict | None = None
    use_rope: bool = True
    tie_word_embeddings: bool = True
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        if self.intermediate_size is None:
            self.intermediate_size = swiglu_width(self.hidden_size)
        if self.layer_types is None:
            self.layer_types = ["bilinear"] * self.num_hidden_layers
        elif isinstance(self.layer_types, (list, tuple)):  # as config.json names them (SAVED_LAYER_TYPES)
            saved = {name: kind for kind, name in SAVED_LAYER_TYPES.items()}
            self.layer_types = [saved.get(kind, kind) for kind in self.layer_types]
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self._validate()
        super().__post_init__(**kwargs)

    def to_dict(self) -> dict:
        """transformers' serialization (config.json, `to_json_string`), a bilinear layer's type saved under its
        transformers name (SAVED_LAYER_TYPES)."""
        output = super().to_dict()
        if isinstance(output.get("layer_types"), list):
            output["layer_types"] = [SAVED_LAYER_TYPES.get(kind, kind) for kind in output["layer_types"]]
        return output

    def validate(self):
        """transformers' ``@strict`` validators (``save_pretrained`` runs them) but ``validate_layer_type``, whose
        allowed types do not include ``"bilinear"``, then this config's own checks (``layer_types`` among them)."""
        for validator in self.__class_validators__:
            if validator.__name__ != "validate_layer_type":
                validator(self)
        self._validate()

    def _validate(self):
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "state_size", "rank",
                    "block_size", "intermediate_size")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BilinearConfig.{name} must be a positive integer, got {value!r}")
        if isinstance(self.norm_chunk_size, bool) or not isinstance(self.norm_chunk_size, int) \
                or self.norm_chunk_size < 0:
            raise ValueError(
                f"BilinearConfig.norm_chunk_size must be an integer >= 0 (0 disables renormalization), "
                f"got {self.norm_chunk_size!r}"
            )
        if isinstance(self.conv_width, bool) or not isinstance(self.conv_width, int) or self.conv_width < 0 \
                or self.conv_width == 1:
            raise ValueError(f"BilinearConfig.conv_width must be 0 (no convolution) or an integer >= 2, "
                             f"got {self.conv_width!r}")
        if isinstance(self.memory_heads, bool) or not isinstance(self.memory_heads, int) or self.memory_heads < 0:
            raise ValueError(f"BilinearConfig.memory_heads must be an integer >= 0 (0: no memory heads), "
                             f"got {self.memory_heads!r}")
        if self.memory_heads:
            for name in ("memory_key_size", "memory_value_size"):
                value = getattr(self, name)
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"BilinearConfig.{name} must be a positive integer, got {value!r}")
            width = self.memory_conv_width
            if isinstance(width, bool) or not isinstance(width, int) or width < 2:
                raise ValueError(f"BilinearConfig.memory_conv_width must be an integer >= 2 (the memory heads' short "
                                 f"convolution), got {width!r}")
        if self.mixer_type not in MIXER_TYPES:
            raise ValueError(f"BilinearConfig.mixer_type must be one of {MIXER_TYPES}, got {self.mixer_type!r}")
        if self.recurrence_impl not in RECURRENCE_IMPLS:
            raise ValueError(
                f"BilinearConfig.recurrence_impl must be one of {RECURRENCE_IMPLS}, got {self.recurrence_impl!r}"
            )
        if self.reset_state_at_eos and self.eos_token_id is None:
            raise ValueError("BilinearConfig.reset_state_at_eos needs eos_token_id (the token that ends a document)")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"BilinearConfig.hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if not self.rms_norm_eps > 0:
            raise ValueError(f"BilinearConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        if not self.initializer_range > 0 or not self.input_factor_init_std >= 0:
            raise ValueError("BilinearConfig.initializer_range must be > 0 and input_factor_init_std >= 0")
        self._validate_layer_types()
        if not self.input_factor_multiplier > 0:
            raise ValueError(f"BilinearConfig.input_factor_multiplier must be > 0 (1: the plain projection), "
                             f"got {self.input_factor_multiplier!r}")

    def _validate_layer_types(self):
        types = self.layer_types
        if not isinstance(types, (list, tuple)) or len(types) != self.num_hidden_layers \
                or any(t not in LAYER_TYPES for t in types):
            raise ValueError(f"BilinearConfig.layer_types must list one of {LAYER_TYPES} per layer "
                             f"(num_hidden_layers={self.num_hidden_layers}), got {types!r}; "
                             "interleaved_layer_types(num_hidden_layers, k) puts attention on every k-th layer")
        if all(t == "bilinear" for t in types):
            return
        for name in ("num_attention_heads", "num_key_value_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"BilinearConfig.{name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads or self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"BilinearConfig.num_attention_heads ({self.num_attention_heads}) must divide hidden_size "
                             f"({self.hidden_size}) and be a multiple of num_key_value_heads "
                             f"({self.num_key_value_heads}): pick head counts that do")
        if "sliding_attention" in types and (isinstance(self.sliding_window, bool)
                                             or not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"BilinearConfig.sliding_window must be a positive integer for 'sliding_attention' "
                             f"layers (the positions each one attends to, itself included), got {self.sliding_window!r}")
        if (self.rope_parameters or {}).get("rope_type", "default") != "default":
            raise ValueError(f"BilinearConfig.rope_parameters: only rope_type 'default' is supported (the model has no "
                             f"maximum length to scale to), got {self.rope_parameters['rope_type']!r}")


__all__ = ["BilinearConfig", "interleaved_layer_types"]
