"""A real transformers model through the hook: a tiny Llama-architecture model built from a
config with a fixed seed (random weights, nothing downloaded), run with
attn_implementation="fa_rs" and with transformers' own "sdpa"/"eager" paths: prefill
logits and a greedy generation with its KV cache must agree. On the CPU in float32 and, where
a GPU is, on CUDA in bfloat16. Skips loudly without torch or transformers."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: the transformers model test is NOT run")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: the model test is NOT run")

from flash_attention_rs import transformers as hook  # noqa: E402

DEVICES = [("cpu", torch.float32)] + ([("cuda", torch.bfloat16)] if torch.cuda.is_available() else [])


def tiny_llama(attn_implementation, device, dtype):
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,  # GQA
        head_dim=16 if device == "cpu" else 64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if device == "cuda":
        config.hidden_size = 512
        config.intermediate_size = 1024
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation)
    assert model.config._attn_implementation == attn_implementation
    return model.to(device=device, dtype=dtype).eval()


def relative(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("device,dtype", DEVICES, ids=[d for d, _ in DEVICES])
def test_llama_prefill_and_greedy_decode_agree(device, dtype, monkeypatch):
    name = hook.register()
    calls = []  # (seqlen_q, seqlen_k) of each call the model makes through the hook
    inner = hook.attention

    def counting(q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1]))
        return inner(q, k, v, **kw)

    monkeypatch.setattr(hook, "attention", counting)
    ours = tiny_llama(name, device, dtype)
    peer_impl = "eager" if device == "cpu" else "sdpa"
    peer = tiny_llama(peer_impl, device, dtype)
    peer.load_state_dict(ours.state_dict())
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 256, (1, 37), generator=gen).to(device)
    with torch.no_grad():
        a = ours(input_ids).logits
        b = peer(input_ids).logits
    err = relative(a, b)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    print(f"\n{device} {dtype}: prefill logits, fa_rs vs {peer_impl}: normwise {err:.2e}")
    assert err <= bound
    assert calls == [(37, 37)] * 2, f"the hook ran {calls} (expected once per layer)"
    calls.clear()
    with torch.no_grad():
        go = ours.generate(input_ids, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        gp = peer.generate(input_ids, max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    # Prefill, then one query against the growing KV cache per new token, in both layers.
    assert calls[:2] == [(37, 37)] * 2 and calls[2:] == [(1, 37 + i) for i in range(1, 12) for _ in range(2)], calls
    new_ours = go.sequences[0, input_ids.shape[1]:].tolist()
    new_peer = gp.sequences[0, input_ids.shape[1]:].tolist()
    print(f"greedy tokens fa_rs:    {new_ours}\ngreedy tokens {peer_impl}:   {new_peer}")
    # Decode steps (one query against the KV cache) agree while the sequences agree.
    same = 0
    while same < len(new_ours) and new_ours[same] == new_peer[same]:
        same += 1
    for step in range(min(same + 1, len(new_ours))):
        step_err = relative(go.logits[step], gp.logits[step])
        assert step_err <= bound * 5, f"decode step {step}: logits differ by {step_err:.2e}"
    if dtype == torch.float32:
        assert new_ours == new_peer
    else:  # bf16: a near-tie may flip late; the first steps must agree
        assert same >= 4, f"greedy generations diverge at step {same}"
