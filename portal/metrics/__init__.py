"""The operator's metrics: ``/metrics`` in Prometheus' text format (docs/deploy.md).

``views`` answers the scrape, ``access`` decides who may, ``figures`` reads the broker
and the database when scraped, ``histograms`` keeps durations in the database (from
any process), and ``task_timing`` times every Celery task through Celery's signals."""
