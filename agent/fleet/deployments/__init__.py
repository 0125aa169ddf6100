"""Desired state: the model registry (``registry``: immutable ``name@version`` with its
artifacts and defaults), device labels (``labels``) and Kubernetes-style selectors over them
(``selectors``), deployments (``deployments``: the tables and the pure per-device decision) and
the service's part that makes the fleet converge (``deployment_runner``).

May import: ``database``, ``rollouts``, ``transfer`` and the base modules, plus ``wire``,
``engines``, ``precision``, ``platform``, ``calib``; never ``admission`` or ``web``.
"""
