"""Downstream evaluation of Hugging Face models with EleutherAI's lm-evaluation-harness (lm-eval).

``evaluate_hf`` hands an in-memory model and tokenizer to lm-eval's ``HFLM`` (so an exported
megatron-ext model, or one with STEM rows edited by ``stem-edit`` (``convert/stem_edit.py``), is
evaluated without a save / reload round trip) and runs ``lm_eval.simple_evaluate`` on tasks
found under ``include_path``.

Offline use: lm-eval needs the ``hf`` extra's ``accelerate`` (imported by ``HFLM``); with an
in-memory model and tasks whose data are local files (``dataset_path: json`` and
``dataset_kwargs.data_files``) nothing is downloaded. Set ``HF_HUB_OFFLINE=1`` and
``HF_DATASETS_OFFLINE=1`` before ``datasets`` / ``huggingface_hub`` are imported to make any
attempt fail fast instead of waiting on the network. ``data_files`` are opened by ``datasets``
relative to the current directory, not to the YAML: give absolute paths.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union


def evaluate_hf(model, tokenizer, tasks: Union[str, Sequence[str]], include_path,
                limit: Optional[Union[int, float]] = None, batch_size: int = 1, *,
                include_defaults: bool = False, num_fewshot: Optional[int] = None,
                random_seed: int = 0) -> dict:
    """Evaluate ``model`` (a ``transformers.PreTrainedModel``, on its device) on ``tasks``.

    ``include_path``: a directory (or list) of task YAMLs. lm-eval's own ~10k task configs are
    indexed only with ``include_defaults=True`` (seconds of start-up, and their data come from
    the Hub). ``limit``: examples per task (an int, or a fraction below 1).

    Returns lm-eval's result dict: per-task metrics in ``out["results"][task]``, e.g.
    ``out["results"]["synthetic_repeat"]["acc,none"]``.
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as e:
        raise ImportError(f"evaluate_hf needs lm-eval with its hf extra (pip install "
                          f"lm-eval==0.4.13 accelerate): {e}") from e

    tasks = [tasks] if isinstance(tasks, str) else list(tasks)
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"tasks {unknown} are not defined under include_path={include_path!r}"
                         f"{'' if include_defaults else ' (include_defaults=False)'}; known: "
                         f"{manager.all_tasks[:20]}")
    was_training = model.training
    model.eval()  # HFLM does not switch an instance it is given to eval mode (dropout)
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        # log_samples=False: the per-example records are large and unused here; the seeds make
        # few-shot sampling reproducible.
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit,
                                       num_fewshot=num_fewshot, task_manager=manager,
                                       log_samples=False, random_seed=random_seed,
                                       numpy_random_seed=random_seed,
                                       torch_random_seed=random_seed,
                                       fewshot_random_seed=random_seed)
    finally:
        model.train(was_training)
