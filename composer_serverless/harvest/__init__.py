"""Preference pairs from N teachers: each state of a student's trace (a prompt and the student's answer) is
asked of N OpenAI-compatible chat endpoints in parallel; the answer ``threshold`` of them agree on is chosen
and the student's answer, where it differs, is rejected. Everything runs under a hard spending cap, with a
content-addressed cache in the store so that nothing is paid for twice.

By job: ``answers.py`` (normalisation and the vote), ``costs.py`` (the cost bound and the cap), ``cache.py``
(the answer cache), ``states.py`` (trace files and a run's rollouts), ``client.py`` (one teacher over httpx:
concurrency, timeouts, retries), ``harvester.py`` (one harvest), ``stats.py`` (its figures and table),
``plan.py`` (``composer-serverless harvest``: checks, the dry run's estimate, the run) and ``live.py`` (the
launcher's harvest between the rounds of a run). Launcher side only: nothing here imports the training stack,
and no replica ever holds a teacher's key.
"""
