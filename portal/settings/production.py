"""Production: PostgreSQL, Redis (broker and cache), SMTP, HTTPS. Nothing has a
silent default that would be wrong in production; missing values fail at start-up.

Redis must run with ``maxmemory-policy noeviction``: an evicted key would be a lost
task or a forgotten rate limit.
"""

from portal import env
from portal.settings.base import *  # noqa: F403
from portal.settings.base import SITE_URL, SNAPSHOT_STORAGE

DEBUG = False
SECRET_KEY = env.secret("SECRET_KEY")
if len(SECRET_KEY) < 50 or len(set(SECRET_KEY)) < 5:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("SECRET_KEY must be at least 50 random characters.")

PORTAL_SECRETS_KEY = env.secret("PORTAL_SECRETS_KEY")
try:
    from cryptography.fernet import Fernet

    Fernet(PORTAL_SECRETS_KEY)
except ValueError:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured(
        "PORTAL_SECRETS_KEY must be a Fernet key (32 url-safe base64 bytes): "
        'python -c "from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())"'
    ) from None
ALLOWED_HOSTS = env.listing("ALLOWED_HOSTS", [])
if not ALLOWED_HOSTS:
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("Set ALLOWED_HOSTS to the portal's host name(s).")

DATABASES = {"default": env.database(env.string("DATABASE_URL"))}
CELERY_BROKER_URL = env.string("CELERY_BROKER_URL")
CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": env.string("CACHE_URL"),
        "KEY_PREFIX": env.string("CACHE_KEY_PREFIX", "portal"),
    }
}
# Sessions are read from Redis and written through to the database: one query less on
# every page, and a Redis restart only costs a read from the database.
SESSION_ENGINE = "django.contrib.sessions.backends.cached_db"
globals().update(env.email(env.string("EMAIL_URL")))

SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
SECURE_SSL_REDIRECT = env.boolean("SECURE_SSL_REDIRECT", True)
# A load balancer polls the backends over plain HTTP, and Prometheus may scrape them
# so inside the private network (a token sent over plain HTTP is sent before any
# redirect, so redirecting /metrics would protect nothing).
SECURE_REDIRECT_EXEMPT = [r"^healthz$", r"^metrics$"]
SECURE_HSTS_SECONDS = env.integer("SECURE_HSTS_SECONDS", 31536000, minimum=0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = env.boolean("SECURE_HSTS_PRELOAD", True)
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
SECURE_REFERRER_POLICY = "same-origin"
X_FRAME_OPTIONS = "DENY"
ACCOUNT_DEFAULT_HTTP_PROTOCOL = "https"
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"},
    "snapshots": SNAPSHOT_STORAGE,
}
if not SITE_URL.startswith("https://"):
    from django.core.exceptions import ImproperlyConfigured

    raise ImproperlyConfigured("SITE_URL must be https:// in production.")
