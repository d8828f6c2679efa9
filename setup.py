"""Packaging for minivllm, read from settings.ini (nbdev-template style, without pkg_resources)."""
import shlex
from configparser import ConfigParser

import setuptools

cfg = ConfigParser(delimiters=['='])
cfg.read('settings.ini', encoding='utf-8')
cfg = cfg['DEFAULT']

licenses = {'apache2': 'Apache-2.0'}
statuses = ['1 - Planning', '2 - Pre-Alpha', '3 - Alpha', '4 - Beta', '5 - Production/Stable', '6 - Mature', '7 - Inactive']
min_python = cfg['min_python']
py_versions = ['3.10', '3.11', '3.12', '3.13']


def reqs(key):
    "The space-separated requirement list under `key` in settings.ini."
    return shlex.split(cfg.get(key, ''))


setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    license=licenses[cfg['license']],
    classifiers=[
        'Development Status :: ' + statuses[int(cfg['status'])],
        'Intended Audience :: ' + cfg['audience'].title(),
        'Natural Language :: ' + cfg['language'].title(),
    ] + ['Programming Language :: Python :: ' + v for v in py_versions[py_versions.index(min_python):]],
    url=cfg['git_url'],
    author=cfg['author'],
    author_email=cfg['author_email'],
    keywords=cfg['keywords'],
    packages=setuptools.find_packages(include=['minivllm', 'minivllm.*']),
    # subtle: the packages live at the clone's root, said explicitly so that `pip install -e .` puts the clone on
    # sys.path (a .pth line) instead of setuptools' import hook, which a folder named minivllm beside a user's
    # script (the clone itself, seen from its parent folder) shadows as an empty namespace package.
    package_dir={'': '.'},
    include_package_data=True,
    package_data={'minivllm': ['default_model/*'],  # the small model `LLM()` uses when given no path
                  'minivllm.cpu': ['*.cpp', '*.h'],  # the C++ kernels' sources, compiled on first use
                  'minivllm.gpu': ['*.json']},  # the Triton attention's tiles measured on GPUs (gpu_check --sweep)
    install_requires=reqs('requirements'),
    extras_require={'dev': reqs('dev_requirements'), 'gpu': reqs('gpu_requirements'),
                    'structured': reqs('structured_requirements')},  # structured outputs (notebook 05b)
    python_requires='>=' + min_python,
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    zip_safe=False,
    entry_points={'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
                  'console_scripts': cfg.get('console_scripts', '').split()},
)
