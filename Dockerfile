# The service image: web (`manage.py serve`: uvicorn, one worker per core) by default; run `python manage.py ingest` from the same image
# for the event consumer. Needs REDIS_URL (and DATABASE_URL for a shared registry) at run time.
# Front-end libraries from the npm registry (package-lock.json), as `make node-deps` does.
FROM node:20-bookworm-slim AS frontend
WORKDIR /app
COPY package.json package-lock.json ./
RUN npm ci --no-audit --no-fund

# The compiled hot path (kvindex/native), built with the full image's compilers, as `make native` does.
FROM python:3.11-bookworm AS native
WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir "$(grep -i '^cython==' requirements.txt)" setuptools
COPY kvindex/native kvindex/native
RUN python kvindex/native/build.py

FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    KVCACHE_VAR_DIR=/var/lib/kvcache \
    HF_HUB_OFFLINE=1

WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt

COPY . .
COPY --from=frontend /app/node_modules ./node_modules
COPY --from=native /app/kvindex/native/_native.*.so kvindex/native/
RUN mkdir -p "$KVCACHE_VAR_DIR" \
    && SECRET_KEY=build-only python manage.py collectstatic --noinput -v 0 \
    && useradd --system --home /app kvcache \
    && chown -R kvcache "$KVCACHE_VAR_DIR"
USER kvcache

EXPOSE 8000 5557
CMD ["sh", "-c", "python manage.py migrate --noinput && exec python manage.py serve --host 0.0.0.0 --port 8000"]
