"""Plumbing shared by every kvoffload process that speaks gRPC: TLS material and channels
(:mod:`rpc.tls`), bearer-token auth (:mod:`rpc.auth`), retries on network errors
(:mod:`rpc.retry`) and structured, secret-masking logs
(:mod:`rpc.logs`). Imports nothing of the processes."""
