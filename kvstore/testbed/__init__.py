"""A multi-host testbed on one machine: hosts in network namespaces (``netns``), Ray across them
(``raycluster``), kvstore on top (``testbed``), and the checks that need it (``probe``,
``headloss``). Root only; see docs/operations/testbed.md."""
