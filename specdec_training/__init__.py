"""Drafter training: prompts from an offline corpus, responses written by the target, and EAGLE-1,
EAGLE-3 and DFlash drafters trained on the target's own features, saved in the published format.
An offline tool beside the services: it uses the executor's models and engine, never its gRPC shell.

corpus.py, prompts.py (prompts and the held-out split) -> target.py (the target, as LoadModel loads it)
-> datagen.py (its responses, through the engine that generation_engine.py builds) -> features.py, dense.py
(what the drafter reads, on dense SDPA with the inference modules) -> unroll.py, losses.py (each method's
training passes and loss) -> recipes.py, init.py (the drafter's shape and starting point) -> trainer.py
(AdamW, checkpoints, resume) -> cli.py (`specdec train-drafter`).
"""
