"""Trainer integrations: stepvault inside the training frameworks people already use.

Each framework has its own module, imported explicitly so that ``import stepvault`` never
pulls in a framework (this package imports none of them):

* :mod:`stepvault.integrations.lightning` — PyTorch Lightning: ``StepvaultCheckpoint``
  (a ``Checkpoint`` callback with stepvault's save/keep policies and async saves) and the
  ``CheckpointIO`` it installs so that ``fit(ckpt_path=ckpt.resume_path)`` resumes from
  the newest checkpoint that verifies. ``pip install "stepvault[lightning]"``.
  :mod:`stepvault.integrations.pytorch_lightning`: the same for the standalone
  ``pytorch_lightning`` package.
* :mod:`stepvault.integrations.transformers` — Hugging Face ``Trainer``:
  ``StepvaultCallback`` plus ``StepvaultTrainer`` (or ``StepvaultTrainerMixin`` for your
  own Trainer subclass). ``pip install "stepvault[transformers]"``.
* :mod:`stepvault.integrations.accelerate` — ``save_state``/``load_state`` for an
  ``Accelerator`` and ``AcceleratorCheckpointer`` (policies, async, retention).
  ``pip install "stepvault[accelerate]"``.

See INTEGRATIONS.md at the repository root.
"""
