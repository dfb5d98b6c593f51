"Tasks for training tests: rewards a random tiny policy already earns some of, so a few steps can raise them."
import torch

from entropy_grpo.tasks import ArithmeticTask, GradedBatch


class DigitTask(ArithmeticTask):
    "Arithmetic prompts; reward = the share of the reply's characters that are digits (no exact or lenient grading)."
    def grade_batch(self, responses, problems):
        recs = [[dict(reward=sum(c.isdigit() for c in r) / max(len(r), 1)) for r in row] for row in responses]
        return GradedBatch(torch.tensor([[r["reward"] for r in row] for row in recs]), recs)
