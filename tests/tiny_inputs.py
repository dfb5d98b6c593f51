"Small inputs the adapter and projection tests share: the attention projections, two padded prompts, a processor."
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def batch(tok):
    "Two left-padded prompts with their attention mask."
    enc = tok(["Question: What is 12 + 7? Answer: 19", "Q: 3 * 3 ="], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def sp_for(model, tok):
    "A quiet SequenceProcessor with 16 new tokens."
    return SequenceProcessor(model, tok, GenerationConfig(max_new_tokens=16), progress=False)
