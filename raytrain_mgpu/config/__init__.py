"""The run's configuration: :class:`~raytrain_mgpu.config.train.TrainConfig` and what reads a config before Ray.

- ``train.py``        ``TrainConfig``, flat as users write it (``from_yaml``, ``replace``, ``to_dict``);
- ``sections.py``     its sections (data, optim, run, ...) as the engine and the strategies read them;
- ``checks.py``       ``validate()``: the one pass over a config (types, ranges, choices, the strategy's rules);
- ``code.py``         the fields that name code, the monitor and its mode;
- ``names.py``        the error's shape and "did you mean"; ``factories.py``: resolving and recording user code;
- ``redact.py``       credentials out of URIs; ``units.py``: sizes such as 24GiB; ``yaml_values.py``: YAML with
                      YAML 1.2's numbers (``1e-3``) for files, the CLI and tune.

Standard library and PyYAML only below ``train.py``'s checks: a bad config costs no import of torch or Ray.
"""
