"""Package set-up, read from settings.ini as nbdev 2 projects do."""
from configparser import ConfigParser
import setuptools


config = ConfigParser(delimiters=['='])
config.read('settings.ini', encoding='utf-8')
cfg = config['DEFAULT']

requirements = cfg.get('requirements', '').split()
dev_requirements = cfg.get('dev_requirements', '').split()
# torch is a requirement, but the set-up installs it only when absent (see Makefile), so a user's own
# CUDA build is kept if it meets the floor: 2.9, for torch.distributed.checkpoint's HuggingFaceStorageWriter with
# save_distributed/enable_consolidation (ilab_nb.core.TORCH_FLOOR; packed rows on CUDA want 2.11, see nbs/explanations/sizes_and_memory.md).
requirements = ['torch>=2.9'] + requirements

setuptools.setup(
    name=cfg['lib_name'],
    version=cfg['version'],
    description=cfg['description'],
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    author=cfg['author'], author_email=cfg['author_email'],
    license='Apache-2.0',
    url=cfg['git_url'],
    project_urls={'Source': cfg['git_url']},
    classifiers=[
        'Development Status :: 3 - Alpha',
        'Intended Audience :: Developers',
        'Intended Audience :: Science/Research',
        'Programming Language :: Python :: 3',
        'Programming Language :: Python :: 3.11',
        'Topic :: Scientific/Engineering :: Artificial Intelligence',
    ],
    keywords=cfg['keywords'].split(),
    python_requires='>=' + cfg['min_python'],
    packages=setuptools.find_namespace_packages(include=['ilab_nb', 'ilab_nb.*']),
    include_package_data=True,
    package_data={'ilab_nb': ['assets/*', 'assets/**/*']},
    install_requires=requirements,
    extras_require={'dev': dev_requirements, 'tensorboard': cfg.get('tensorboard_requirements', '').split(),
                    'mlflow': cfg.get('mlflow_requirements', '').split(), 'wandb': cfg.get('wandb_requirements', '').split(),
                    'trackio': cfg.get('trackio_requirements', '').split(),
                    'eval': cfg.get('eval_requirements', '').split(),
                    'export': cfg.get('export_requirements', '').split(),
                    'ray': cfg.get('ray_requirements', '').split(),
                    'qlora': cfg.get('qlora_requirements', '').split(),
                    'search': cfg.get('search_requirements', '').split()},
    entry_points={
        'console_scripts': cfg.get('console_scripts', '').split(),
        'nbdev': [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
    zip_safe=False,
)
