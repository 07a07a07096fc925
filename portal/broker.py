"""The embedded broker: kombu's SQLAlchemy transport on a SQLite file, polled often.

kombu passes every broker transport option to ``create_engine``, so options meant for
the transport itself (``polling_interval``) or for Redis (``visibility_timeout``)
break it. This transport keeps them away from the engine; ``portal.celery`` installs
it for ``sqla+`` URLs.
"""

from kombu.transport import sqlalchemy
from sqlalchemy import create_engine

# Options that mean something to kombu's transports, not to SQLAlchemy's engine.
_NOT_FOR_THE_ENGINE = {
    "queue_tablename",
    "message_tablename",
    "callback",
    "errback",
    "max_retries",
    "interval_start",
    "interval_step",
    "interval_max",
    "retry_errors",
    "polling_interval",
    "visibility_timeout",
}


class Channel(sqlalchemy.Channel):
    def _engine_from_config(self):
        conninfo = self.connection.client
        options = {
            key: value
            for key, value in conninfo.transport_options.items()
            if key not in _NOT_FOR_THE_ENGINE
        }
        # SQLite allows one writer: wait for the lock instead of failing at once.
        if conninfo.hostname.startswith("sqlite"):
            options.setdefault("connect_args", {"timeout": 30})
        return create_engine(conninfo.hostname, **options)


class Transport(sqlalchemy.Transport):
    Channel = Channel
