"""The iptables text toolkit, shared by the firewall (firewall/) and the fallback backend
(fallback/): `iptables-save` text read (`parse`), `iptables-restore` transactions written
(`transaction`), the tools run (`tools`), and what was saved kept while nf_tables' generation
stays (`generation`). It knows no owner's chains: each caller says which chains are its own
and which jumps it wants.

Imports: netlink (nlsocket, codec), host.commands, errors, the standard library.
"""
