"""Front ends of other libraries, each imported only when used (``import paddle_hsdp``
imports none of them, so none of their dependencies is needed for the rest):

* :mod:`paddle_hsdp.integrations.paddleformers`: PaddleFormers' ``Trainer`` with HSDP
  (``HSDPTrainingArguments``, ``HSDPTrainer``).
"""
