"""The exported Hugging Face code (``megatron_ext/convert/hf_code``) against plain-PyTorch
references of ``docs/convert.md``: every MLP type, a whole mixed model, KV-cached greedy
generation (also with left padding), the save / ``trust_remote_code`` round trip, the
self-containment of the two files, and config validation. Tiny fp32 models, CPU only.
"""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.convert.hf_code import modeling_megatron_ext as hf_modeling
from megatron_ext.convert.hf_code.configuration_megatron_ext import MegatronExtConfig

HF_CODE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "megatron_ext", "convert", "hf_code")
CODE_FILES = ("configuration_megatron_ext.py", "modeling_megatron_ext.py")
AUTO_MAP = {"AutoConfig": "configuration_megatron_ext.MegatronExtConfig",
            "AutoModelForCausalLM": "modeling_megatron_ext.MegatronExtForCausalLM"}

V, H, F_DENSE = 37, 16, 24
TOL = dict(rtol=1e-5, atol=1e-5)

DENSE = {"type": "dense", "intermediate_size": F_DENSE}


def stem(variant):
    return {"type": "stem", "variant": variant, "intermediate_size": 20}


def structmoe(fusion, top_k=2):
    return {"type": "structmoe", "intermediate_size": 20, "num_experts": 4, "rank": 3,
            "top_k": top_k, "fusion": fusion}


def moe(top_k):
    return {"type": "moe", "num_experts": 4, "top_k": top_k, "intermediate_size": 12}


def config(mlp_layers, gated=True, act="silu", qk_norm=False, tied=False, **kw):
    args = dict(vocab_size=V, hidden_size=H, num_hidden_layers=len(mlp_layers),
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6,
                rope_theta=100.0, max_position_embeddings=64, hidden_act=act, gated_mlp=gated,
                qk_norm=qk_norm, tie_word_embeddings=tied, mlp_layers=mlp_layers)
    args.update(kw)
    return MegatronExtConfig(**args)


@torch.no_grad()
def randomize(module, seed=0):
    """Weights of order one (the 0.02 init makes every layer nearly the identity, so a wrong
    formula could hide); norm weights around one."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            p.copy_(1.0 + 0.2 * noise)
        elif "embed_tokens" in name or "stem_table" in name:
            p.copy_(noise)
        else:
            fan_in = p.shape[-2] if p.dim() == 3 else p.shape[-1]  # lore_a/b: [L, in, out]
            p.copy_(noise / math.sqrt(fan_in))
    return module


def model(cfg, seed=0):
    torch.manual_seed(seed)
    return randomize(hf_modeling.MegatronExtForCausalLM(cfg), seed).eval()


# ---------------------------------------------------------------------------------------------
# plain-PyTorch references of docs/convert.md, from the tensors by their Hugging Face names


def ref_act(name, x):
    if name == "silu":
        return x * torch.sigmoid(x)
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))  # exact GELU


def ref_rms(x, w, eps):
    x32 = x.float()
    return w * (x32 / torch.sqrt((x32 * x32).mean(-1, keepdim=True) + eps)).to(x.dtype)


def ref_topk_softmax(x, w_router, k):
    """Per token: probabilities p = softmax(x W^T) in fp32, the k largest (index, p)."""
    logits = x.float() @ w_router.float().T
    p = torch.exp(logits - logits.max()) / torch.exp(logits - logits.max()).sum()
    order = sorted(range(p.numel()), key=lambda e: -p[e].item())[:k]
    return [(e, p[e]) for e in order]


def ref_mlp(sd, spec, cfg, x, t):
    """x [n, H] (normed hidden states), t [n] token ids -> [n, H]; token by token."""
    act = lambda v: ref_act(cfg.hidden_act, v)  # noqa: E731
    w = lambda name: sd[f"{name}.weight"]       # noqa: E731
    out = []
    for n in range(x.shape[0]):
        xn = x[n]
        kind = spec["type"]
        if kind == "dense":
            if cfg.gated_mlp:
                inner = act(w("gate_proj") @ xn) * (w("up_proj") @ xn)
            else:
                inner = act(w("up_proj") @ xn)
            y = w("down_proj") @ inner
        elif kind == "stem":  # Eqs. 4-5 of the STEM paper
            u = w("stem_table")[t[n]]
            if spec["variant"] == "up":
                inner = act(w("gate_proj") @ xn) * u
            elif spec["variant"] == "gate":
                inner = act(u) * (w("up_proj") @ xn)
            else:
                inner = act(w("gate_proj") @ xn) * (w("up_proj") @ xn + u)
            y = w("down_proj") @ inner
        elif kind == "structmoe":  # Eqs. 5-6 of the StructMoE paper
            r = sum(p * (xn @ sd["lore_a"][l] @ sd["lore_b"][l])
                    for l, p in ref_topk_softmax(xn, w("router"), spec["top_k"]))
            up = w("up_proj") @ xn
            if cfg.gated_mlp:
                gate = w("gate_proj") @ xn
                inner = act(gate + r) * up if spec["fusion"] == "additive" \
                    else act(gate) * up * (1 + r)
            else:
                inner = act(up + r) if spec["fusion"] == "additive" else act(up) * (1 + r)
            y = w("down_proj") @ inner
        else:  # Sigma MoE: weights are the softmax probabilities, not renormalised
            y = sum(p * (w(f"experts.{e}.down_proj") @ (act(w(f"experts.{e}.gate_proj") @ xn) *
                                                         (w(f"experts.{e}.up_proj") @ xn)))
                    for e, p in ref_topk_softmax(xn, w("gate"), spec["top_k"]))
        out.append(y)
    return torch.stack(out)


def ref_rope(x, positions, theta):
    """x [s, heads, hd]: non-interleaved RoPE (rotate halves)."""
    hd = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, :]
    rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * cos + rotated * sin


def ref_forward(sd, cfg, ids):
    """Logits [s, V] of one unpadded sequence ids [s]."""
    s, nh, ng, hd, eps = ids.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, \
        cfg.head_dim, cfg.rms_norm_eps
    h = sd["model.embed_tokens.weight"][ids]
    pos = torch.arange(s)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for i, spec in enumerate(cfg.mlp_layers):
        p = f"model.layers.{i}."
        a = ref_rms(h, sd[p + "input_layernorm.weight"], eps)
        q = (a @ sd[p + "self_attn.q_proj.weight"].T).view(s, nh, hd)
        k = (a @ sd[p + "self_attn.k_proj.weight"].T).view(s, ng, hd)
        v = (a @ sd[p + "self_attn.v_proj.weight"].T).view(s, ng, hd)
        if cfg.qk_norm:
            q = ref_rms(q, sd[p + "self_attn.q_norm.weight"], eps)
            k = ref_rms(k, sd[p + "self_attn.k_norm.weight"], eps)
        q, k = ref_rope(q, pos, cfg.rope_theta), ref_rope(k, pos, cfg.rope_theta)
        heads = []
        for j in range(nh):
            g = j // (nh // ng)  # query head j reads KV group g
            scores = (q[:, j] @ k[:, g].T) / math.sqrt(hd)
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = torch.exp(scores - scores.max(-1, keepdim=True).values)
            heads.append((probs / probs.sum(-1, keepdim=True)) @ v[:, g])
        h = h + torch.cat(heads, -1) @ sd[p + "self_attn.o_proj.weight"].T
        m = ref_rms(h, sd[p + "post_attention_layernorm.weight"], eps)
        layer = {k[len(p + "mlp."):]: t for k, t in sd.items() if k.startswith(p + "mlp.")}
        h = h + ref_mlp(layer, spec, cfg, m, ids)
    h = ref_rms(h, sd["model.norm.weight"], eps)
    head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    return h @ head.T


# ---------------------------------------------------------------------------------------------
# 1. each MLP type, and its tensor names / shapes (docs/convert.md)

MLP_CASES = {
    "dense_gated": (DENSE, True, "silu"),
    "dense_gelu": (DENSE, False, "gelu"),
    "stem_up": (stem("up"), True, "silu"),
    "stem_gate": (stem("gate"), True, "silu"),
    "stem_dagger": (stem("dagger"), True, "silu"),
    "stem_dagger_geglu": (stem("dagger"), True, "gelu"),
    "structmoe_additive_gated": (structmoe("additive"), True, "silu"),
    "structmoe_glu_gated": (structmoe("glu"), True, "silu"),
    "structmoe_additive_plain": (structmoe("additive"), False, "gelu"),
    "structmoe_glu_plain": (structmoe("glu", top_k=1), False, "gelu"),
    "moe_top1": (moe(1), True, "silu"),
    "moe_top2": (moe(2), True, "silu"),
}

EXPECTED_SHAPES = {
    "dense_gated": {"gate_proj.weight": (24, H), "up_proj.weight": (24, H),
                    "down_proj.weight": (H, 24)},
    "dense_gelu": {"up_proj.weight": (24, H), "down_proj.weight": (H, 24)},
    "stem_up": {"gate_proj.weight": (20, H), "stem_table.weight": (V, 20),
                "down_proj.weight": (H, 20)},
    "stem_gate": {"up_proj.weight": (20, H), "stem_table.weight": (V, 20),
                  "down_proj.weight": (H, 20)},
    "stem_dagger": {"gate_proj.weight": (20, H), "up_proj.weight": (20, H),
                    "stem_table.weight": (V, 20), "down_proj.weight": (H, 20)},
    "structmoe_additive_gated": {"gate_proj.weight": (20, H), "up_proj.weight": (20, H),
                                 "down_proj.weight": (H, 20), "router.weight": (4, H),
                                 "lore_a": (4, H, 3), "lore_b": (4, 3, 20)},
    "structmoe_additive_plain": {"up_proj.weight": (20, H), "down_proj.weight": (H, 20),
                                 "router.weight": (4, H), "lore_a": (4, H, 3),
                                 "lore_b": (4, 3, 20)},
    "moe_top2": {"gate.weight": (4, H),
                 **{f"experts.{e}.{n}.weight": s for e in range(4)
                    for n, s in (("gate_proj", (12, H)), ("up_proj", (12, H)),
                                 ("down_proj", (H, 12)))}},
}


@pytest.mark.parametrize("case", sorted(MLP_CASES))
def test_mlp_matches_reference(case):
    spec, gated, act = MLP_CASES[case]
    cfg = config([spec], gated=gated, act=act)
    torch.manual_seed(1)
    mlp = randomize(hf_modeling.MLP_CLASSES[spec["type"]](cfg, spec), seed=1)
    x = torch.randn(3, 5, H)
    t = torch.randint(0, V, (3, 5))
    with torch.no_grad():
        got = mlp(x, t)
        want = ref_mlp(mlp.state_dict(), spec, cfg, x.reshape(-1, H), t.reshape(-1))
    torch.testing.assert_close(got, want.view(3, 5, H), rtol=1e-5, atol=1e-6)
    if case in EXPECTED_SHAPES:
        shapes = {k: tuple(v.shape) for k, v in mlp.state_dict().items()}
        assert shapes == EXPECTED_SHAPES[case]


def test_routing_uses_unnormalised_probabilities():
    """The router's weights are the top-k softmax probabilities themselves: they do not sum to
    one over the selected experts (shared by StructMoE, Eq. 5, and Sigma)."""
    cfg = config([moe(2)])
    layer = randomize(hf_modeling.MegatronExtMoEMLP(cfg, moe(2)), seed=3)
    x = torch.randn(6, H)
    with torch.no_grad():
        p = torch.softmax(x @ layer.gate.weight.T, -1)
        weights, _ = hf_modeling._route(x, layer.gate.weight, 2)
        torch.testing.assert_close(weights, p.topk(2, -1).values)
        assert (weights.sum(-1) < 1 - 1e-3).all()


# ---------------------------------------------------------------------------------------------
# 2. a whole mixed model against the reference forward

MIXED = [DENSE, stem("dagger"), structmoe("glu"), moe(2), stem("up"), moe(1)]


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_matches_reference(qk_norm, tied):
    cfg = config(MIXED, qk_norm=qk_norm, tied=tied)
    m = model(cfg, seed=2)
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logits = m(input_ids=ids, use_cache=False).logits
    sd = m.state_dict()
    if tied:
        assert m.lm_head.weight is m.model.embed_tokens.weight
    for row in range(2):
        torch.testing.assert_close(logits[row], ref_forward(sd, cfg, ids[row]), **TOL)


def test_model_gelu_not_gated_matches_reference():
    cfg = config([DENSE, structmoe("additive"), structmoe("glu", top_k=1)], gated=False,
                 act="gelu", qk_norm=True)
    m = model(cfg, seed=4)
    ids = torch.randint(0, V, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = m(input_ids=ids).logits
    torch.testing.assert_close(logits[0], ref_forward(m.state_dict(), cfg, ids[0]), **TOL)


def test_loss_logits_to_keep_and_inputs_embeds():
    cfg = config([DENSE, structmoe("additive"), moe(2)])
    m = model(cfg, seed=7)
    ids = torch.randint(0, V, (2, 6), generator=torch.Generator().manual_seed(8))
    labels = ids.clone()
    labels[0, 2] = -100
    with torch.no_grad():
        out = m(input_ids=ids, labels=labels)
        # Llama's shift: position i predicts label i + 1; -100 ignored.
        want = F.cross_entropy(out.logits[:, :-1].reshape(-1, V), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
        torch.testing.assert_close(out.loss, want)
        last = m(input_ids=ids, logits_to_keep=1).logits
        torch.testing.assert_close(last, out.logits[:, -1:])
        embeds = m(inputs_embeds=m.get_input_embeddings()(ids)).logits
        torch.testing.assert_close(embeds, out.logits)
        hidden = m(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hidden) == cfg.num_hidden_layers + 1


def test_stem_model_refuses_inputs_embeds():
    m = model(config([DENSE, stem("up")]))
    with pytest.raises(ValueError, match="input_ids"):
        m(inputs_embeds=torch.randn(1, 3, H))


# ---------------------------------------------------------------------------------------------
# 3. generation with the KV cache


def greedy_without_cache(m, ids, new_tokens):
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = m(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return ids


def generate(m, ids, new_tokens, **kw):
    return m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                      do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None, **kw)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
def test_generate_with_cache_matches_full_forwards(qk_norm):
    m = model(config(MIXED, qk_norm=qk_norm), seed=9)
    ids = torch.randint(0, V, (2, 5), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        got = generate(m, ids, 6)
    torch.testing.assert_close(got, greedy_without_cache(m, ids, 6), rtol=0, atol=0)


def test_generate_left_padded_batch_matches_single_prompts():
    m = model(config(MIXED, qk_norm=True), seed=11)
    gen = torch.Generator().manual_seed(12)
    prompts = [torch.randint(1, V, (6,), generator=gen), torch.randint(1, V, (3,), generator=gen)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(2, width, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = p
        mask[row, width - len(p):] = 1
    with torch.no_grad():
        batched = generate(m, ids, 5, attention_mask=mask)
        for row, p in enumerate(prompts):
            alone = generate(m, p[None], 5)
            assert batched[row, width:].tolist() == alone[0, len(p):].tolist()
            # the single prompt also agrees with the no-cache loop
            assert alone.tolist() == greedy_without_cache(m, p[None], 5).tolist()


# ---------------------------------------------------------------------------------------------
# 4. save_pretrained + AutoModelForCausalLM.from_pretrained(trust_remote_code=True)


@pytest.fixture
def private_hf_modules(tmp_path, monkeypatch):
    """Remote code is copied into the default ``HF_MODULES_CACHE`` and imported as the package
    ``transformers_modules``, as for a user (each test saves under its own directory name, so
    copies do not collide). Swapping that cache per test broke the import once another test had
    already loaded remote code in this process (``transformers_modules`` stays imported)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    yield


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_save_and_load_with_remote_code(tmp_path, private_hf_modules, tied):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = config(MIXED, qk_norm=True, tied=tied, bos_token_id=1, eos_token_id=2)
    cfg.auto_map = dict(AUTO_MAP)
    m = model(cfg, seed=13)
    out = tmp_path / f"export_{'tied' if tied else 'untied'}"
    m.save_pretrained(out)
    for name in CODE_FILES:
        shutil.copy(os.path.join(HF_CODE, name), out / name)

    saved = json.loads((out / "config.json").read_text())
    assert saved["auto_map"] == AUTO_MAP and saved["model_type"] == "megatron_ext"
    assert saved["mlp_layers"] == MIXED
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert ("lm_head.weight" in names) != tied
    assert names | ({"lm_head.weight"} if tied else set()) == set(m.state_dict())

    assert type(AutoConfig.from_pretrained(out, trust_remote_code=True)).__name__ == \
        "MegatronExtConfig"
    loaded, info = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                        output_loading_info=True)
    loaded.eval()
    assert type(loaded).__name__ == "MegatronExtForCausalLM"
    assert type(loaded).__module__.startswith("transformers_modules")  # the copied file
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if tied:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    mine, theirs = m.state_dict(), loaded.state_dict()
    assert set(mine) == set(theirs)
    for name, t in mine.items():
        assert torch.equal(t, theirs[name]), name
    ids = torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(14))
    with torch.no_grad():
        want = m(input_ids=ids).logits
        # The loaded weights live in the mmap'd file at offsets that are not 64-byte aligned,
        # which changes the CPU GEMM's summation order in the last bit ...
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-6, atol=1e-6)
        assert generate(loaded, ids, 3).tolist() == generate(m, ids, 3).tolist()
        # ... copied to fresh memory, the logits are bitwise identical.
        for p in loaded.parameters():
            p.data = p.data.clone()
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# 5. the two files are self-contained


@pytest.mark.parametrize("name", CODE_FILES)
def test_code_imports_only_torch_transformers_stdlib(name):
    with open(os.path.join(HF_CODE, name)) as f:
        tree = ast.parse(f.read())
    allowed = {"torch", "transformers"} | set(sys.stdlib_module_names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: only the file beside it (HF copies it along)
                assert node.level == 1 and node.module == "configuration_megatron_ext", \
                    ast.dump(node)
                continue
            roots = [node.module.split(".")[0]]
        else:
            continue
        assert set(roots) <= allowed, f"{name}: imports {roots}"


# ---------------------------------------------------------------------------------------------
# 6. configuration


def test_default_config_builds_a_model():
    cfg = MegatronExtConfig()
    assert cfg.model_type == "megatron_ext" and len(cfg.mlp_layers) == cfg.num_hidden_layers
    small = MegatronExtConfig(vocab_size=11, hidden_size=8, num_attention_heads=2)
    assert small.head_dim == 4 and small.num_key_value_heads == 2
    hf_modeling.MegatronExtForCausalLM(small)


BAD_CONFIGS = {
    "mlp_layers": dict(mlp_layers=[DENSE]),  # two layers
    "type": dict(mlp_layers=[DENSE, {"type": "mamba", "intermediate_size": 8}]),
    "variant": dict(mlp_layers=[DENSE, {"type": "stem", "variant": "down",
                                        "intermediate_size": 8}]),
    "fusion": dict(mlp_layers=[DENSE, dict(structmoe("additive"), fusion="mul")]),
    "top_k": dict(mlp_layers=[DENSE, dict(moe(2), top_k=5)]),
    "rank": dict(mlp_layers=[DENSE, {k: v for k, v in structmoe("glu").items() if k != "rank"}]),
    "intermediate_size": dict(mlp_layers=[DENSE, dict(DENSE, intermediate_size=0)]),
    "num_key_value_heads": dict(num_attention_heads=4, num_key_value_heads=3),
    "hidden_act": dict(hidden_act="relu"),
    "gated_mlp": dict(gated_mlp=False, mlp_layers=[DENSE, stem("up")]),
    "head_dim": dict(head_dim=5),
}


@pytest.mark.parametrize("field", sorted(BAD_CONFIGS))
def test_bad_config_names_the_field(field):
    kwargs = dict(vocab_size=V, hidden_size=H, num_hidden_layers=2, num_attention_heads=4,
                  mlp_layers=[DENSE, DENSE])
    kwargs.update(BAD_CONFIGS[field])
    with pytest.raises(ValueError, match=field):
        MegatronExtConfig(**kwargs)
