"""The shape of a multi-head latent attention (MLA) decoder, DeepSeek-V2/V3 and GLM-5 style: :class:`MLAConfig`,
its reader and writer of Hugging Face ``config.json`` (``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``,
``glm_moe_dsa``), presets, and parameter counts computed from the config alone (nothing allocated)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from piecegraph.models.config import ModelConfig, _rope_parameters, _rope_theta

MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "deepseek_v32", "glm_moe_dsa")
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")  # the types with a DSA indexer (always)
ROUTINGS = ("softmax", "sigmoid")
INDEXER_TYPES = ("full", "shared")
_MAX_DEFAULT_CACHE_LEN = 4096
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "attention_factor", "truncate")


@dataclass(frozen=True)
class MLAConfig(ModelConfig):
    """An MLA decoder (DeepSeek-V2/V3/V3.2, Kimi-K2, GLM-5): latent attention, an optional DSA indexer, MoE layers.

    As a KV-cache shape (:class:`~piecegraph.attention.types.CacheShape`) it is one latent "head" per token:
    ``num_kv_heads`` is 1, ``head_dim`` is ``kv_lora_rank`` (the cache's k holds the compressed latent),
    ``v_head_dim`` is ``qk_rope_head_dim`` (the cache's v holds the rotary key), ``index_head_dim`` sizes the
    indexer's key cache (0: no indexer), and ``mla`` is True. ``num_kv_heads`` and ``head_dim`` are derived, not
    arguments. The model's own value head dim (Hugging Face's ``v_head_dim``) is ``value_head_dim``.

    Attention: ``q_lora_rank`` (0: a plain ``q_proj``, as DeepSeek-V2-Lite), ``kv_lora_rank``, ``qk_nope_head_dim``
    + ``qk_rope_head_dim`` per query/key head, ``attention_bias`` (biases of q_a, kv_a and o projections).
    RoPE: ``rope_theta``; ``rope_interleave`` (rotary dims in interleaved pairs, as DeepSeek and GLM-5 store them);
    ``rope_scaling`` a tuple of ``(key, value)`` pairs of a YaRN ``rope_parameters`` (empty: plain RoPE).
    DSA (DeepSeek-V3.2, GLM-5): ``index_n_heads`` heads of ``index_head_dim`` (its first ``qk_rope_head_dim`` dims
    rotated: in interleaved pairs if ``index_rope_interleave``, as GLM-5; else in halves, as V3.2), ``index_topk``
    keys per query, ``indexer_types`` per layer (``"full"``: own indexer; ``"shared"``: the previous full layer's
    choice; empty: all full). MoE: ``num_experts`` (0: every layer dense, width
    ``intermediate_size``) of width ``expert_width``, ``top_k``, ``num_shared_experts`` (shared expert width
    ``num_shared_experts * expert_width``), ``first_k_dense`` leading dense layers (or ``mlp_layer_types``, one
    ``"dense"``/``"sparse"`` per layer), ``routing`` (``"softmax"``: DeepSeek-V2; ``"sigmoid"`` with
    ``e_score_correction_bias``: V3, GLM-5), ``n_group``/``topk_group`` (group-limited choice; 1: none),
    ``norm_topk_prob``, ``routed_scaling_factor``, ``expert_impl`` (as :class:`~piecegraph.models.MoEConfig`).
    ``model_type`` names the Hugging Face type :meth:`to_hf` writes.

    Example: ``TINY_MLA.replace(num_layers=3)``.
    """

    mla: ClassVar[bool] = True
    num_kv_heads: int = field(init=False, default=1)
    head_dim: int = field(init=False, default=0)
    kv_lora_rank: int = field(kw_only=True)
    qk_nope_head_dim: int = field(kw_only=True)
    qk_rope_head_dim: int = field(kw_only=True)
    value_head_dim: int = field(kw_only=True)
    q_lora_rank: int = field(default=0, kw_only=True)
    attention_bias: bool = field(default=False, kw_only=True)
    rope_interleave: bool = field(default=True, kw_only=True)
    rope_scaling: tuple = field(default=(), kw_only=True)
    index_n_heads: int = field(default=0, kw_only=True)
    index_head_dim: int = field(default=0, kw_only=True)
    index_topk: int = field(default=0, kw_only=True)
    index_rope_interleave: bool = field(default=True, kw_only=True)
    indexer_types: tuple = field(default=(), kw_only=True)
    num_experts: int = field(default=0, kw_only=True)
    top_k: int = field(default=0, kw_only=True)
    expert_width: int = field(default=0, kw_only=True)
    num_shared_experts: int = field(default=0, kw_only=True)
    first_k_dense: int = field(default=0, kw_only=True)
    mlp_layer_types: tuple = field(default=(), kw_only=True)
    routing: str = field(default="sigmoid", kw_only=True)
    n_group: int = field(default=1, kw_only=True)
    topk_group: int = field(default=1, kw_only=True)
    norm_topk_prob: bool = field(default=True, kw_only=True)
    routed_scaling_factor: float = field(default=1.0, kw_only=True)
    expert_impl: str = field(default="auto", kw_only=True)
    model_type: str = field(default="deepseek_v3", kw_only=True)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_kv_heads", 1)
        object.__setattr__(self, "head_dim", self.kv_lora_rank)
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "value_head_dim"):
            _check_int(name, getattr(self, name), 1)
        for name in ("q_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "num_experts", "top_k",
                     "expert_width", "num_shared_experts", "first_k_dense"):
            _check_int(name, getattr(self, name), 0)
        _check_int("n_group", self.n_group, 1)
        _check_int("topk_group", self.topk_group, 1)
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLAConfig.qk_rope_head_dim must be even for rotary embeddings, got "
                             f"{self.qk_rope_head_dim}")
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"MLAConfig.model_type must be one of {MODEL_TYPES}, got {self.model_type!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"MLAConfig.routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.rope_scaling and dict(self.rope_scaling).get("rope_type", "yarn") != "yarn":
            raise ValueError(f"MLAConfig.rope_scaling: only YaRN is implemented, got {dict(self.rope_scaling)}")
        self._check_indexer()
        self._check_experts()

    def _check_indexer(self) -> None:
        if not self.index_head_dim:
            if self.index_n_heads or self.index_topk or self.indexer_types:
                raise ValueError("MLAConfig: index_n_heads, index_topk and indexer_types need index_head_dim > 0")
            return
        if not (self.index_n_heads and self.index_topk and self.q_lora_rank):
            raise ValueError("MLAConfig: a DSA indexer (index_head_dim > 0) needs index_n_heads > 0, index_topk > 0 "
                             "and q_lora_rank > 0 (its query reads the q_a latent)")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"MLAConfig.index_head_dim ({self.index_head_dim}) must be at least qk_rope_head_dim "
                             f"({self.qk_rope_head_dim}): its first qk_rope_head_dim dims are rotated")
        types = self.layer_indexer_types
        if len(types) != self.num_layers or any(t not in INDEXER_TYPES for t in types) or types[0] != "full":
            raise ValueError(f"MLAConfig.indexer_types must name {INDEXER_TYPES[0]!r} or {INDEXER_TYPES[1]!r} for "
                             f"each of the {self.num_layers} layers, the first 'full'; got {self.indexer_types}")

    def _check_experts(self) -> None:
        sparse = [t == "sparse" for t in self.layer_mlp_types]
        if len(sparse) != self.num_layers:
            raise ValueError(f"MLAConfig.mlp_layer_types needs one entry per layer ({self.num_layers}), got "
                             f"{len(sparse)}")
        if not any(sparse):
            return
        if not (self.num_experts and self.expert_width and 1 <= self.top_k <= self.num_experts):
            raise ValueError("MLAConfig: sparse layers need num_experts > 0, expert_width > 0 and "
                             f"1 <= top_k <= num_experts, got {self.num_experts}, {self.expert_width}, {self.top_k}")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"MLAConfig: num_experts ({self.num_experts}) must divide into n_group "
                             f"({self.n_group}) groups, and topk_group ({self.topk_group}) <= n_group")
        if self.routing == "sigmoid" and self.num_experts // self.n_group < 2:
            raise ValueError("MLAConfig: sigmoid routing scores a group by its two best experts: each of the "
                             f"n_group groups needs >= 2 experts, got {self.num_experts // self.n_group}")

    # -- the cache shape --------------------------------------------------------------------------------
    @property
    def v_head_dim(self) -> int:
        """The cache's v per token: the rotary key (see the class docstring; the value head is ``value_head_dim``)."""
        return self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def layer_indexer_types(self) -> tuple[str, ...]:
        """Per layer ``"full"`` or ``"shared"`` (empty when there is no indexer)."""
        if not self.index_head_dim:
            return ()
        return tuple(self.indexer_types) or ("full",) * self.num_layers

    @property
    def layer_mlp_types(self) -> tuple[str, ...]:
        """Per layer ``"dense"`` or ``"sparse"``."""
        if self.mlp_layer_types:
            return tuple(self.mlp_layer_types)
        dense = self.num_layers if not self.num_experts else min(self.first_k_dense, self.num_layers)
        return ("dense",) * dense + ("sparse",) * (self.num_layers - dense)

    def replace(self, **changes: Any) -> "MLAConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # -- Hugging Face config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], max_seq_len: int | None = None) -> "MLAConfig":
        """Read a ``config.json`` dict of a :data:`MODEL_TYPES` model, as transformers builds that model: the
        DeepSeek-V2 router ignores ``norm_topk_prob`` and uses groups only with ``topk_method="group_limited_greedy"``;
        attention rotates interleaved pairs, in V3 only when ``rope_interleave`` (default true); V3.2's indexer runs
        in every layer and rotates halves, GLM-5's rotates pairs and follows ``indexer_types``. MTP layers
        (``num_nextn_predict_layers``) are not part of the config (the loader skips their weights). ``max_seq_len``
        defaults to ``max_position_embeddings`` capped at 4096. Raises ``ValueError`` naming the key for a missing
        key, another model type, a quantized checkpoint, RoPE scaling other than YaRN, another activation or MLP
        biases."""
        model_type = hf.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config.json model_type {model_type!r} is not an MLA model; expected one of "
                             f"{MODEL_TYPES}")
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "kv_lora_rank",
                    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if hf.get(key) is None:
                raise ValueError(f"config.json lacks required key {key!r} (model_type {model_type!r})")
        _refuse(hf, model_type)
        layers = hf["num_hidden_layers"]
        dense_first = int(hf.get("first_k_dense_replace") or 0)
        moe = _moe_fields(hf, model_type)
        mlp_types = tuple(hf.get("mlp_layer_types") or ()) if model_type in DSA_TYPES else ()
        if mlp_types == ("dense",) * min(dense_first, layers) + ("sparse",) * max(layers - dense_first, 0):
            mlp_types = ()  # what first_k_dense_replace says anyway
        index = {}
        if model_type in DSA_TYPES:  # transformers' DeepSeek-V3.2 reads no indexer_types: all layers full
            v32 = model_type == "deepseek_v32"
            index = dict(index_n_heads=hf.get("index_n_heads", 64 if v32 else 32),
                         index_head_dim=hf.get("index_head_dim", 128), index_topk=hf.get("index_topk", 2048),
                         indexer_types=() if v32 else _indexer_types(hf, layers), index_rope_interleave=not v32)
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf.get("intermediate_size") or 1, num_layers=layers,
            num_heads=hf["num_attention_heads"], rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=_rope_theta(hf), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=max_seq_len or min(int(hf.get("max_position_embeddings", 2048)), _MAX_DEFAULT_CACHE_LEN),
            kv_lora_rank=hf["kv_lora_rank"], qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"], value_head_dim=hf["v_head_dim"],
            q_lora_rank=hf.get("q_lora_rank") or 0, attention_bias=bool(hf.get("attention_bias", False)),
            rope_interleave=model_type != "deepseek_v3" or bool(hf.get("rope_interleave", True)),
            rope_scaling=_yarn(hf), first_k_dense=dense_first, mlp_layer_types=mlp_types, model_type=model_type,
            **moe, **index)

    def to_hf(self) -> dict[str, Any]:
        """A ``config.json`` dict of :attr:`model_type` that transformers and :meth:`from_hf` read back as this
        shape. A DeepSeek-V2 config needs softmax routing without ``norm_topk_prob``, the others sigmoid routing;
        V3.2 an indexer in every layer rotating halves, GLM-5 one rotating pairs; all but V3 interleaved RoPE
        (``ValueError`` otherwise)."""
        kind = self.model_type
        want_softmax = kind == "deepseek_v2"
        if (self.routing == "softmax") != want_softmax or (want_softmax and self.norm_topk_prob and
                                                          self.num_experts):
            raise ValueError(f"MLAConfig.to_hf: model_type {kind!r} routes with "
                             f"{'softmax, no norm_topk_prob' if want_softmax else 'sigmoid'}; this config does not")
        dsa, v32 = kind in DSA_TYPES, kind == "deepseek_v32"
        if dsa != bool(self.index_head_dim) or (kind != "deepseek_v3" and not self.rope_interleave) or (dsa and (
                self.index_rope_interleave == v32 or (v32 and "shared" in self.layer_indexer_types))):
            raise ValueError(f"MLAConfig.to_hf: model_type {kind!r} does not match this config's indexer "
                             f"({DSA_TYPES} only, and always; deepseek_v32's full in every layer with "
                             "index_rope_interleave false, glm_moe_dsa's true) or rope_interleave (deepseek_v3 "
                             "only may be false)")
        rope = {"rope_theta": self.rope_theta, "rope_type": "default", **dict(self.rope_scaling)}
        if self.rope_scaling:
            rope["rope_type"] = "yarn"
        out = {
            "architectures": [{"deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
                               "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[kind]],
            "model_type": kind, "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_heads,
            "kv_lora_rank": self.kv_lora_rank, "q_lora_rank": self.q_lora_rank or None,
            "qk_nope_head_dim": self.qk_nope_head_dim, "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.value_head_dim, "attention_bias": self.attention_bias, "rms_norm_eps": self.rms_eps,
            "rope_parameters": rope, "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_seq_len, "hidden_act": "silu",
            "n_routed_experts": max(self.num_experts, 1), "num_experts_per_tok": max(self.top_k, 1),
            "moe_intermediate_size": max(self.expert_width, 1), "n_shared_experts": self.num_shared_experts,
            "first_k_dense_replace": self.first_k_dense,
            "routed_scaling_factor": self.routed_scaling_factor, "n_group": self.n_group,
            "topk_group": self.topk_group, "norm_topk_prob": self.norm_topk_prob,
        }
        if kind == "deepseek_v2":
            out["topk_method"] = "group_limited_greedy" if self.n_group > 1 else "greedy"
        if kind == "deepseek_v3":
            out["rope_interleave"] = self.rope_interleave
            out["num_nextn_predict_layers"] = 0
        if dsa:
            out.update(index_n_heads=self.index_n_heads, index_head_dim=self.index_head_dim,
                       index_topk=self.index_topk, mlp_layer_types=list(self.layer_mlp_types))
        if kind == "glm_moe_dsa":
            out["indexer_types"] = list(self.layer_indexer_types)
        return out

    # -- sizes ------------------------------------------------------------------------------------------
    def parameter_counts(self) -> tuple[int, int]:
        """``(total, active)`` parameters of :class:`~piecegraph.models.mla.MLADecoder` of this shape (buffers
        such as the routers' ``e_score_correction_bias`` excluded), and those one token uses (its ``top_k``
        routed experts of each sparse layer), computed without allocating."""
        h, heads, r, p = self.hidden_size, self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim
        bias = self.attention_bias
        if self.q_lora_rank:
            q = h * self.q_lora_rank + bias * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * \
                self.qk_head_dim
        else:
            q = h * heads * self.qk_head_dim
        kv = h * (r + p) + bias * (r + p) + r + r * heads * (self.qk_nope_head_dim + self.value_head_dim)
        attention = q + kv + heads * self.value_head_dim * h + bias * h + 2 * h  # + o_proj + 2 norms
        di, hi = self.index_head_dim, self.index_n_heads
        indexer = self.q_lora_rank * hi * di + h * di + 2 * di + h * hi if di else 0
        expert = 3 * h * self.expert_width
        sparse = h * self.num_experts + self.num_shared_experts * expert  # router + shared experts
        total = active = self.vocab_size * h * (1 if self.tie_embeddings else 2) + h  # + final norm
        for i, kind in enumerate(self.layer_mlp_types):
            own = attention + (indexer if self.layer_indexer_types[i:i + 1] == ("full",) else 0)
            if kind == "dense":
                total, active = total + own + 3 * h * self.intermediate_size, active + own + 3 * h * \
                    self.intermediate_size
            else:
                total += own + sparse + self.num_experts * expert
                active += own + sparse + self.top_k * expert
        return total, active


def _check_int(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"MLAConfig.{name} must be an int >= {low}, got {value!r}")


def _refuse(hf: Mapping[str, Any], model_type: str) -> None:
    problems = []
    if hf.get("quantization_config"):
        method = dict(hf["quantization_config"]).get("quant_method", "?")
        problems.append(f"quantization_config ({method}) with its weights kept quantized: load the folder with "
                        "piecegraph.models.load_mla (as `piecegraph serve DIR` does), which dequantizes them")
    if hf.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf['hidden_act']!r}")
    if hf.get("mlp_bias"):
        problems.append("mlp_bias=true")
    rope = _rope_parameters(hf)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in (None, "default", "yarn"):
        problems.append(f"RoPE scaling rope_type={kind!r} (default and yarn are implemented)")
    if problems:
        raise ValueError(f"config.json ({model_type}) has {'; '.join(problems)}, which piecegraph's MLA decoder "
                         "does not compute")


def _yarn(hf: Mapping[str, Any]) -> tuple:
    """YaRN's parameters as sorted ``(key, value)`` pairs (empty for plain RoPE); ``factor`` None becomes
    ``max_position_embeddings / original_max_position_embeddings``, as transformers computes it."""
    rope = _rope_parameters(hf)
    if rope.get("rope_type", rope.get("type", "default")) != "yarn":
        return ()
    out = {k: rope[k] for k in _YARN_KEYS if rope.get(k) is not None}
    if "original_max_position_embeddings" not in out:
        raise ValueError("config.json: YaRN rope scaling lacks original_max_position_embeddings")
    if "factor" not in out:
        out["factor"] = hf["max_position_embeddings"] / out["original_max_position_embeddings"]
    return tuple(sorted(out.items()))


def _moe_fields(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    experts = int(hf.get("n_routed_experts") or 0)
    out: dict[str, Any] = dict(num_experts=experts, top_k=int(hf.get("num_experts_per_tok") or 0),
                               expert_width=int(hf.get("moe_intermediate_size") or 0),
                               num_shared_experts=int(hf.get("n_shared_experts") or 0),
                               routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0))
    if model_type == "deepseek_v2":  # transformers' V2 router: softmax, no renormalization, groups only if asked
        grouped = hf.get("topk_method", "greedy") == "group_limited_greedy"
        out.update(routing="softmax", norm_topk_prob=False, n_group=int(hf["n_group"]) if grouped else 1,
                   topk_group=int(hf["topk_group"]) if grouped else 1)
    else:
        out.update(routing="sigmoid", norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                   n_group=int(hf.get("n_group") or 1), topk_group=int(hf.get("topk_group") or 1))
    return out


def _indexer_types(hf: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """GLM-5's per-layer indexer modes, derived as transformers' GlmMoeDsaConfig derives them."""
    types = _indexer_pattern(hf, layers)
    return () if types == ("full",) * layers else types  # empty: all full, as MLAConfig reads it


def _indexer_pattern(hf: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    if hf.get("indexer_types"):
        return tuple(hf["indexer_types"])
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return tuple({"F": "full", "S": "shared"}[c] for c in pattern) if isinstance(pattern, str) else tuple(pattern)
    freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers))


# For CPU tests: DeepSeek-V3 style (q_lora, sigmoid routing in 2 groups, a shared expert, one dense layer).
TINY_MLA = MLAConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, max_seq_len=256,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, value_head_dim=16, q_lora_rank=48,
    num_experts=8, top_k=2, expert_width=32, num_shared_experts=1, first_k_dense=1, n_group=2, topk_group=1,
    routed_scaling_factor=2.5, expert_impl="gather",
)

# GLM-5 style for CPU tests: a DSA indexer choosing 8 keys (prompts longer than 8 go sparse), the second layer
# sharing the first's choice.
TINY_GLM5 = TINY_MLA.replace(
    model_type="glm_moe_dsa", index_n_heads=8, index_head_dim=16, index_topk=8, indexer_types=("full", "shared"),
    n_group=1, topk_group=1,
)

# DeepSeek-V3's dimensions (its config.json: 128 heads, q_lora 1536, kv_lora 512, 256 experts top-8 in 8 groups of
# which 4, one shared expert, YaRN x40) with 5 layers instead of 61 (3 dense + 2 MoE, all 256 experts): ~26.6B
# parameters, ~53 GB in bf16, to fit one 80 GB GPU with a KV cache. Random weights only: it names no checkpoint.
DEEPSEEK_V3_SHAPE = MLAConfig(
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_layers=5, num_heads=128, rms_eps=1e-6,
    rope_theta=10000.0, max_seq_len=4096, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
    value_head_dim=128, q_lora_rank=1536,
    rope_scaling=(("beta_fast", 32), ("beta_slow", 1), ("factor", 40.0), ("mscale", 1.0), ("mscale_all_dim", 1.0),
                  ("original_max_position_embeddings", 4096)),
    num_experts=256, top_k=8, expert_width=2048, num_shared_experts=1, first_k_dense=3, n_group=8, topk_group=4,
    routed_scaling_factor=2.5,
)

# GLM-5's dimensions (its transformers config: 64 heads, q_lora 2048, kv_lora 512, qk 192 + 64, v 256, indexer 32
# heads x 128 choosing 2048 keys, 256 experts top-8, one shared expert) with 5 layers instead of 78 (3 dense + 2
# MoE, all 256 experts): ~22.9B parameters, ~46 GB in bf16. Random weights only: it names no checkpoint.
GLM5_SHAPE = MLAConfig(
    vocab_size=154880, hidden_size=6144, intermediate_size=12288, num_layers=5, num_heads=64, rms_eps=1e-5,
    rope_theta=1e6, max_seq_len=8192, kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64,
    value_head_dim=256, q_lora_rank=2048, index_n_heads=32, index_head_dim=128, index_topk=2048,
    num_experts=256, top_k=8, expert_width=2048, num_shared_experts=1, first_k_dense=3,
    routed_scaling_factor=2.5, model_type="glm_moe_dsa",
)
