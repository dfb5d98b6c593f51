"Small inputs tests share: the attention projections, two padded prompts, a processor, probe components and U."
import copy

from entropy_grpo.dr_grpo import group_advantages
from entropy_grpo.probes import BatchConfig, ProbeComponents
from entropy_grpo.sequence_processor import GenerationConfig, SequenceProcessor
from entropy_grpo.tasks import ArithmeticTask

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def batch(tok):
    "Two left-padded prompts with their attention mask."
    enc = tok(["Question: What is 12 + 7? Answer: 19", "Q: 3 * 3 ="], return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def sp_for(model, tok):
    "A quiet SequenceProcessor with 16 new tokens."
    return SequenceProcessor(model, tok, GenerationConfig(max_new_tokens=16), progress=False)


def probe_components(policy, top_p=0.95, n_problems=50, **bc):
    "ProbeComponents on a copy of `policy` (model, tokenizer): arithmetic problems, temperature 0.9, 8 new tokens."
    model, tok = copy.deepcopy(policy)
    gen = GenerationConfig(temperature=0.9, top_p=top_p, max_new_tokens=8)
    return ProbeComponents(model, tok, ArithmeticTask(n=n_problems), gen,
                           BatchConfig(**{**dict(E_total_sequences=24, B_U=4, G=4), **bc}))


def with_advantages(U):
    "The tiny policy's random bytes earn no reward: a stand-in reward with group variance gives a real gradient."
    r = U["sequences"].double()[..., -3:].mean(-1)
    return {**U, "rewards": r, "advantages": group_advantages(r)}
