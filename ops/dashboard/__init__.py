"""A self-contained live dashboard on the daemon's HTTP server (no CDN, no build step).

    recorder = Recorder.from_supervisor(supervisor, lag=lambda: heartbeater.lag)
    HttpServer(..., extra_routes=lambda app: dashboard_routes(app, recorder))
    # and start `recorder.run()` in the deployment's task group

``GET /dashboard`` serves one HTML page whose inline script polls ``GET /dashboard/data`` every
second and draws line charts as inline SVG.
"""

from ops.dashboard.recorder import CHARTS, Chart, Recorder, StatsSource, supervisor_source
from ops.dashboard.routes import DataSource, dashboard_routes

__all__ = ["CHARTS", "Chart", "DataSource", "Recorder", "StatsSource", "dashboard_routes", "supervisor_source"]
