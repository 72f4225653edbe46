# kvroute: KV-cache-aware routing index for vLLM fleets.
# Build: docker build -t kvroute .    Run: docker run -p 8080:8080 kvroute

# The wheel, built where a C compiler is: the index's compiled loops (index/_fast.pyx)
# the route's token reader (app/api/_token_scan.pyx) and the live drain
# (app/ingest/_live_drain.pyx, which needs libzmq's header) are the compiled twins of pure
# Python references. The image that runs kvroute carries no compiler.
FROM python:3.11-slim AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libxxhash-dev libzmq3-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /src

# Only what the distribution needs: the tests, benchmarks and chart stay out
# of the image (see .dockerignore).
COPY pyproject.toml setup.py README.md ./
COPY index ./index
COPY app ./app
COPY sim ./sim
# Without a compiler the build would still pass, with the pure loops: here that is an error.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && python -c "import glob, sys, zipfile; names = zipfile.ZipFile(glob.glob('/wheels/kvroute-*.whl')[0]).namelist(); missing = [m for m in ('kvroute/index/_fast.', 'kvroute/app/api/_token_scan.', 'kvroute/app/ingest/_live_drain.') if not any(n.startswith(m) and n.endswith('.so') for n in names)]; sys.exit(f'compiled modules missing from the wheel: {missing}' if missing else 0)"

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /srv/kvroute

COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/kvroute-*.whl \
    && rm -rf /wheels \
    && groupadd --system --gid 10001 kvroute \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --shell /usr/sbin/nologin kvroute \
    && install -d -o 10001 -g 10001 -m 0750 /var/lib/kvroute

# Saved state (docs/saved-state.md): the index is saved here every state_save_interval
# seconds and on a graceful stop, and loaded on start, so a restart does not route blind
# while the instances replay. A volume, so a read-only root filesystem still works; mount
# a named volume or host directory (owned by uid 10001) to keep it across containers.
# With KVROUTE_STATE_URL (Valkey/Redis shared by replicas) set KVROUTE_STATE_DIR= (empty):
# the two exclude each other.
ENV KVROUTE_STATE_DIR=/var/lib/kvroute
VOLUME ["/var/lib/kvroute"]

# Never run as root; a numeric uid lets Kubernetes verify runAsNonRoot.
USER 10001

# 8080: the HTTP API; 9002: the Endpoint Picker's gRPC, when --epp-port 9002 is given.
EXPOSE 8080 9002

# The slim image has no curl: probe /healthz with the interpreter that is already there.
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status == 200 else 1)"]

# Inside a container 127.0.0.1 is reachable only from the container itself, so
# the service must bind every interface for the port mapping or the Kubernetes
# Service to reach it. Outside containers kvroute defaults to loopback. On every
# interface it starts only with KVROUTE_API_TOKEN / KVROUTE_ADMIN_TOKEN set, or with
# KVROUTE_ALLOW_UNAUTHENTICATED=true on a trusted network.
CMD ["kvroute", "serve", "--host", "0.0.0.0", "--port", "8080"]
