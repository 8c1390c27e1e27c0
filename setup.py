"""Build hook: ship the repository's sql/ (the one source of truth) inside the package.

sql/ stays at the repository root. Building a wheel copies it to
queen_timers/sql/ in the build tree, so an installed `queen-timers migrate`
finds its migrations from any directory (python/queen_timers/db.py looks
there first, then at the checkout's sql/). Everything else is in pyproject.toml.
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class build_py_with_sql(build_py):
    def run(self):
        super().run()
        if self.editable_mode:  # an editable install reads the checkout's sql/ directly
            return
        source = ROOT / "sql"
        if not (source / "migrations").is_dir():
            raise SystemExit(f"setup.py: {source}/migrations is missing; cannot package the SQL")
        target = Path(self.build_lib) / "queen_timers" / "sql"
        if target.exists():  # a file removed from sql/ must not linger from an earlier build
            shutil.rmtree(target)
        for path in sorted(source.rglob("*.sql")):
            dest = target / path.relative_to(source)
            self.mkpath(str(dest.parent))
            self.copy_file(str(path), str(dest))


setup(cmdclass={"build_py": build_py_with_sql})
