"""Running a fleet on an orchestrator (Kubernetes): identity from the environment
(:mod:`metaps.deploy.identity`) and manifests generated from the job file
(:mod:`metaps.deploy.k8s`, ``metaps deploy k8s``)."""
