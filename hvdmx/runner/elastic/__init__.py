"""hvdmxrun's side of an elastic job (docs/elastic.md); the ranks' side is
hvdmx/elastic/.

    hosts       the job's hosts: discovery, blacklist, numbering of ranks
    membership  who is in the job, generation by generation
    service     the elastic rendezvous: a worker's place in each generation
    loop        the workers started, watched, their hosts failed
    job         hvdmxrun's elastic job: the service, the workers, the loop
"""
