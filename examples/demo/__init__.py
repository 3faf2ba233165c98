"""The demo RL loop (`rollout-sidecar demo`), installed as `rollout_sidecar.demo`.

Its own home because its needs are not the trainer package's: besides torch
and httpx it uses transformers (the model), tqdm and matplotlib (progress and
report; the `demo` extra) and the server's embedded default model. It uses
only the public client and trainer APIs, as a user's loop would.
"""
