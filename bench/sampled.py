"""Sequences sampled from the embedded SmolLM2-135M-Instruct, for benchmarks that need realistic logits.

Random token ids make a language model unsure of everything (on SmolLM2 the top-p 0.95 nucleus at T 0.7 holds a median
of ~3,000 tokens after random ids, 2 after real text), so figures measured on them describe a worst case, not training.
`sample_sequences` draws what GRPO scores: chat prompts cut to their last `prompt_len` tokens, then exactly
`new_tokens` sampled tokens (EOS suppressed until then) at the given temperature and top-p.
"""
import torch

QUESTIONS = [
    "Explain in detail how a bicycle's gears make it easier to ride up a hill, with an example.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What were the main causes of the French Revolution? Give a thorough answer.",
    "Describe step by step how to bake a loaf of sourdough bread at home.",
    "Compare Python and C for writing a fast numerical simulation, with pros and cons.",
    "Why is the sky blue during the day and red at sunset? Explain the physics.",
    "Plan a three-day trip to Rome for someone who loves history and food.",
    "Solve: a train leaves at 3pm going 60 km/h; another at 4pm going 80 km/h. When does the second catch up?",
]


def sample_sequences(model, tokenizer, n:int=8, prompt_len:int=32, new_tokens:int=224, temperature:float=0.7,
                     top_p:float=0.95, seed:int=0) -> torch.Tensor:
    "[n, prompt_len + new_tokens] token ids: the last prompt_len tokens of a chat prompt, then new_tokens sampled."
    prompts = []
    for q in (QUESTIONS * n)[:n]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        if ids.shape[-1] < prompt_len: raise ValueError(f"prompt has {ids.shape[-1]} tokens: expected >= {prompt_len}")
        prompts.append(ids[0, -prompt_len:])
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(torch.stack(prompts), attention_mask=torch.ones(n, prompt_len, dtype=torch.long),
                             do_sample=True, temperature=temperature, top_p=top_p, top_k=0, min_new_tokens=new_tokens,
                             max_new_tokens=new_tokens, pad_token_id=tokenizer.pad_token_id)
    return out
