"""``kvmesh make-secrets NAME=KEY[,KEY...] ...``: create each missing Secret with random values,
keep every one that exists (the chart's pre-install/pre-upgrade hook Job)."""

from __future__ import annotations

import argparse


def register(commands) -> None:
    make = commands.add_parser(
        "make-secrets",
        help="create missing Kubernetes Secrets with random values; never change an existing one",
        description="Creates each named Secret that does not exist, with a random value under each "
        "key (secrets.token_urlsafe), through the Kubernetes API with this pod's service account. "
        "A Secret that exists is kept as it is. Prints names, never values.",
    )
    make.add_argument(
        "secrets",
        nargs="+",
        metavar="NAME=KEY[,KEY...]",
        help="a Secret and the keys it holds, e.g. llm-kvmesh-redis-auth=admin,router,replica",
    )
    make.add_argument("--namespace", help="default: this pod's namespace (from its service account)")
    make.add_argument(
        "--label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label on every Secret created (repeatable)",
    )
    make.add_argument(
        "--api-server",
        help="the Kubernetes API, https://HOST:PORT (default: from KUBERNETES_SERVICE_HOST/PORT)",
    )
    make.add_argument(
        "--token-file",
        help="bearer token for the API (default: /var/run/secrets/kubernetes.io/serviceaccount/token)",
    )
    make.add_argument(
        "--ca-file",
        help="CA of the API server (default: /var/run/secrets/kubernetes.io/serviceaccount/ca.crt)",
    )
    make.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from kvmesh.cluster import kube_secrets as kube
    from kvmesh.cluster.errors import UsageError

    try:
        specs = [kube.SecretSpec.parse(text) for text in args.secrets]
        names = [s.name for s in specs]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"secret {twice[0]!r} is named twice")
        labels = dict(kube.parse_label(text) for text in args.label)
        server = args.api_server or kube.default_api_server()
        if not server:
            raise ValueError(
                "no API server: not in a pod (KUBERNETES_SERVICE_HOST unset) and no --api-server"
            )
        namespace = args.namespace or _read_namespace(kube.NAMESPACE_FILE)
        client = kube.KubeClient.from_files(
            server, namespace, args.token_file or kube.TOKEN_FILE, args.ca_file or kube.CA_FILE
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for spec in specs:
        try:
            outcome = kube.ensure(client, spec, labels)
        except kube.KubeError as exc:
            print(f"kvmesh: error: {exc}", file=sys.stderr)
            return 1
        what = "created" if outcome == "created" else "kept (exists)"
        print(f"secret {namespace}/{spec.name}: {what}, keys {', '.join(spec.keys)}", flush=True)
    return 0


def _read_namespace(path) -> str:
    try:
        namespace = path.read_text().strip()
    except OSError as exc:
        raise ValueError(f"no --namespace, and cannot read {str(path)!r}: {exc.strerror}") from None
    if not namespace:
        raise ValueError(f"no --namespace, and {str(path)!r} is empty")
    return namespace
