"""Catalogue of supported sparse models, downloads, hardware probe and fit estimates.

Imports neither torch nor Qt (DESIGN.md): the window and the CLI use it before any
engine is loaded. The public API, by module (import each name from its module; this package re-exports
nothing):

- `resolve.resolve_model(name_or_path) -> Path`, `paths.models_dir()`,
  `paths.set_models_dir(path|None)`, `paths.set_offline(bool)`
- `catalogue.load_catalogue()`, `find_entry(id_or_repo)`   (catalogue.json, data)
- `download.download_model(name, progress=, control=, on_predictors_downloaded=, ...)`,
  `download.verify_model(dir)`; `progress.DownloadControl` (pause/resume/cancel),
  `progress.DownloadEvent`                                  (Hub downloads)
- `repo_check.check_repo(repo_id)`, `check_folder(path)`  (refuse unsupported models early)
- `manage.list_models(hardware=, ctx=, extra=)`, `remove_model`, `import_model`
- `hardware.probe_hardware() -> HardwareInfo`
- `fit.estimate_fit(config_dict, ctx=, vram_budget=, ram_budget=, hardware=, model_dir=)`
- `token.save_token / clear_token / get_token`
"""
