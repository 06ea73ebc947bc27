"""`pagoda router`: a reverse proxy spreading OpenAI API requests over several servers.

settings.py  RouterSettings, and the checks on backend URLs
backends.py  the backend pool: health checks, ejection and re-admission, polling GET /load
policies.py  which backend a request goes to: p2c, round_robin, prefix (rendezvous hashing)
proxy.py     the aiohttp app: forwarding, retries before the first byte, SSE relayed as it arrives
metrics.py   the router's own Prometheus registry (/metrics)
service.py   running it: listening, start-up probes, systemd readiness, draining on SIGTERM
cli.py       the `pagoda router` flags
"""
