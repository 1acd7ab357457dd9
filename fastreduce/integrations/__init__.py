"""Drop-in integrations with the trainers users already run; each is an optional extra,
imported only when used (importing :mod:`fastreduce` never imports a trainer library).

- :mod:`fastreduce.integrations.transformers`: ``FastReduceTrainer``, a Hugging Face
  ``transformers.Trainer`` that reduces gradients with fastreduce instead of DDP, and
  the helpers of the Accelerate recipe (``pip install fastreduce[hf]``).
- :mod:`fastreduce.integrations.lightning`: ``FastReduceStrategy``, a Lightning
  ``DDPStrategy`` that does not wrap the model in DDP (``pip install fastreduce[lightning]``).
- :mod:`fastreduce.integrations.optimum_habana`: ``install()`` makes optimum-habana's
  ``GaudiTrainer`` (``distribution_strategy="fast_ddp"``) call fastreduce.
"""
