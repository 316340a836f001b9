"""`gyrfalcon train-eagle3`: train an EAGLE3 draft head for a target model.

The phases, one module each (docs/train_eagle3.md walks them):

- `args`: the flags (`TrainArgs`, one frozen dataclass);
- `data`: prompts (JSONL), the chat template, the target's own greedy answers from
  our in-process engine (`LocalEngine`, one generation loop: `complete`), the draft
  vocabulary (d2t);
- `instructions`: user instructions the target writes itself (--self-instructions);
- `features`: the target's aux hidden states and final hidden state per token, one
  PREFILL of the target over each answered sequence;
- `drafter`: the `LlamaForCausalLMEagle3` being trained (config for the target,
  initial weights, export);
- `ttt`: the drafter's differentiable forward with training-time test, on the very
  parameters of that module;
- `objective`: the loss against the target's distribution, and acceptance;
- `ema`: an exponential moving average of the weights (--ema-decay);
- `trainer`: the loop, progress, evaluation on held-out prompts, the checkpoint.

Only `gyrfalcon.cli` imports this package.
"""
