"""The Flask routes of the web view: every one a GET that renders a PoolData document."""

from __future__ import annotations

import flask

from slurm_idle.web import data as d
from slurm_idle.web import display
from slurm_idle.web.plots import pool_24h_png


def viewer(user_header: str | None, local_user: str | None) -> str | None:
    """Who is looking: the user the site's proxy put in `user_header` (web.user_header), else
    the user the view runs as when that is not root (`local_user`); None: nobody known.
    `?user=` never names the viewer: anyone can type it."""
    if user_header:
        return flask.request.headers.get(user_header) or None
    return local_user


def make_app(data: d.PoolData, timezone: str = "UTC", user_header: str | None = None,
             local_user: str | None = None) -> flask.Flask:
    app = flask.Flask("slurm_idle.web")
    # Times in the site's zone, "18:30" on the page's own day (the document's generated_at).
    app.jinja_env.filters["localtime"] = lambda v, now=None: display.human_time(v, timezone, now)
    app.jinja_env.filters["logpieces"] = lambda line, now=None: display.log_pieces(
        line, timezone, now)
    app.jinja_env.filters["zone"] = lambda now: display.zone_name(timezone, now)
    app.jinja_env.filters["age"] = display.age

    @app.get("/")
    def pool_view() -> str:
        doc = data.pool()
        return flask.render_template("pool.html", doc=doc, gpus=d.gpu_counts(doc), page="pool")

    @app.get("/jobs")
    def jobs_view() -> str:
        user = flask.request.args.get("user") or None
        doc = data.jobs(user, viewer(user_header, local_user))
        return flask.render_template("jobs.html", doc=doc, page="jobs")

    @app.get("/plot/pool-24h.png")
    def pool_plot() -> flask.Response:
        png = pool_24h_png(data.pool(), timezone)
        return flask.Response(png, mimetype="image/png", headers={"Cache-Control": "no-store"})

    @app.get("/api/pool")
    def api_pool() -> flask.Response:
        return flask.jsonify(data.pool())

    @app.get("/api/jobs")
    def api_jobs() -> flask.Response:
        return flask.jsonify(data.jobs(flask.request.args.get("user") or None,
                                       viewer(user_header, local_user)))

    @app.get("/healthz")
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.after_request
    def headers(resp: flask.Response) -> flask.Response:
        resp.headers.setdefault("X-Content-Type-Options", "nosniff")
        resp.headers.setdefault("Content-Security-Policy",
                                "default-src 'self'; img-src 'self' data:; style-src 'self'")
        return resp

    return app
